"""DeepSpeed's engine over a zeal :class:`~zeal.train.engine.TrainEngine`: what
``deepspeed.initialize`` returns.

As DeepSpeed's, it is an ``nn.Module`` whose submodule ``module`` is the model:
``parameters()`` / ``named_parameters()`` (``module.``-prefixed names), ``buffers()``,
``train()`` / ``eval()``, ``engine(batch)`` → ``forward``. ``state_dict()`` holds the
whole model under ``module.`` keys (full values, gathered at ZeRO-3) and
``load_state_dict`` takes them back. DeepSpeed's method names live here, on the facade
(composition: zeal's engine is ``.engine``); their semantics are DeepSpeed's where they
differ from zeal's (``wall_clock_breakdown()`` and ``loss_scale()`` read the config).

A DeepSpeed name zeal does not implement raises :class:`~zeal.deepspeed.refusals.Refused`
at the attribute, one line naming the API and what to use instead; any other name is looked up
on the model, as DeepSpeed's engine does (``engine.gradient_checkpointing_enable()``)."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from zeal.config.schema import CompileConfig
from zeal.deepspeed.engine_accessors import DeepSpeedAccessors
from zeal.deepspeed.engine_parts import (
    _DELEGATED,
    _FIXED,
    _MOVES,
    _REASONS,
    _ZERO_FIELDS,
    Monitor,
    ThroughputTimer,
)
from zeal.deepspeed.engine_parts import (
    flops_field as _flops_field,
)
from zeal.deepspeed.refusals import Refused, deepspeed_names, reason_by_prefix

_last: weakref.ref | None = None  # the zeal engine of the most recent initialize (deepspeed.utils.groups)

class DeepSpeedEngine(DeepSpeedAccessors, nn.Module):
    """``engine(batch)``, ``engine.backward(loss)``, ``engine.step()`` (or ``train_batch``
    for a pipeline) and DeepSpeed's accessors (:mod:`zeal.deepspeed.engine_accessors`),
    over zeal's engine ``.engine``."""

    def __init__(self, engine: Any) -> None:
        super().__init__()
        object.__setattr__(self, "engine", engine)  # not a submodule: its module is ours
        self.module = engine.module
        self.monitor = Monitor()
        self.tput_timer = ThroughputTimer(self.train_batch_size())
        self._applied = False
        if engine.config.zero_optimization.stage == 3:
            from zeal.deepspeed.zero import mark_partitioned

            mark_partitioned(engine.module)  # DeepSpeed's ds_* markers, which its scripts test
        global _last
        _last = weakref.ref(engine)

    # -- attribute lookup: nn.Module's, zeal's shared names, refusals, then the model's (as DeepSpeed) --
    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        if name in _DELEGATED:
            return getattr(self.__dict__["engine"], name)
        if name in _ZERO_FIELDS:
            field = _ZERO_FIELDS[name]
            return lambda: getattr(self.__dict__["engine"].config.zero_optimization, field)
        if name in _FIXED:
            return lambda: _FIXED[name]
        if (field := _flops_field(name)) is not None:
            return lambda: getattr(self.__dict__["engine"].config.flops_profiler, field)
        error = _refusal(name)
        if isinstance(error, _NotDeepSpeed):  # as DeepSpeed's: the model's own attributes pass through
            module = self._modules.get("module")
            if module is not None and not name.startswith("__"):
                try:
                    return getattr(module, name)
                except AttributeError:
                    pass
        raise error

    def __getattribute__(self, name: str) -> Any:
        if name in _MOVES:
            raise Refused(f"DeepSpeedEngine.{name}", _REASONS[name])
        return super().__getattribute__(name)

    def compile(self, backend: str = "inductor", compile_kwargs: dict | None = None, schedule: Any = None,
                compiled_autograd_enabled: bool = False) -> None:
        """DeepSpeed's ``engine.compile``: each block of the model compiled with ``torch.compile``
        (regional, as the config's ``compile`` section does at ``initialize``)."""
        if schedule is not None or compiled_autograd_enabled:
            raise Refused("DeepSpeedEngine.compile(schedule=/compiled_autograd_enabled=)",
                          "DeepCompile passes and compiled autograd are not supported: call compile(backend, "
                          "compile_kwargs)")
        from zeal.train.compile import apply_compile

        apply_compile(self.module, CompileConfig(enabled=True, backend=backend, kwargs=dict(compile_kwargs or {})))
        self.__dict__["_compiled"] = True

    @property
    def is_compiled(self) -> bool:
        """Whether :meth:`compile` ran (or the config's ``compile`` section was enabled)."""
        return self.__dict__.get("_compiled", False) or self.engine.config.compile.enabled

    # -- the loop ------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``model(*args, **kwargs)`` on this rank's inputs (moved to the device, floats cast
        to the compute dtype); a lone dict / tuple batch is unpacked."""
        return self.engine.forward(*args, **kwargs)

    def backward(self, loss: Any, retain_graph: bool = False, scale_wrt_gas: bool = True, **kwargs: Any) -> Any:
        """Back-propagate ``loss`` (divided by the accumulation steps unless ``scale_wrt_gas``
        is False); returns the loss, as DeepSpeed's. ``allreduce_gradients=False`` is refused."""
        if kwargs.get("allreduce_gradients", True) is False:
            raise Refused("DeepSpeedEngine.backward(allreduce_gradients=False)", _REASONS["no_sync"])
        self.engine.backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)
        return loss

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Count the micro-step; at the accumulation boundary update the model (and the lr
        schedule). ``lr_kwargs`` is refused when given (zeal's schedules take no arguments)."""
        if lr_kwargs:
            raise Refused("DeepSpeedEngine.step(lr_kwargs=...)", "zeal's lr schedules step without arguments")
        before, boundary = self.engine.skipped_steps, self.engine.at_boundary
        self.engine.step()
        if boundary:
            self._applied = self.engine.skipped_steps == before
            self.tput_timer.update(self.train_batch_size())

    def train_batch(self, data_iter: Any = None) -> torch.Tensor:
        """One pipeline step over ``gradient_accumulation_steps`` micro-batches from
        ``data_iter`` (default: the loader from ``training_data``); the mean loss."""
        if not hasattr(self.engine, "train_batch"):
            raise Refused("DeepSpeedEngine.train_batch", "it is the pipeline engine's: give deepspeed.initialize a "
                          "PipelineModule (or pipeline_parallel.size > 1); otherwise call engine(batch), "
                          "engine.backward(loss), engine.step()")
        before = self.engine.skipped_steps
        loss = self.engine.train_batch(data_iter)
        self._applied = self.engine.skipped_steps == before
        self.tput_timer.update(self.train_batch_size())
        return loss

    def eval_batch(self, data_iter: Any = None, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str = "avg", bcast_loss: bool = True, num_micro_batches: int | None = None) -> Any:
        """The mean loss over ``gradient_accumulation_steps`` micro-batches, forward only
        (pipeline engine). ``return_logits`` / ``compute_loss=False`` /
        ``num_micro_batches`` / ``reduce_output`` other than ``"avg"`` are refused."""
        if not hasattr(self.engine, "eval_batch"):
            raise Refused("DeepSpeedEngine.eval_batch", "it is the pipeline engine's; run the model under "
                          "torch.no_grad() with engine.eval()")
        if return_logits or not compute_loss or num_micro_batches is not None or reduce_output != "avg":
            raise Refused("PipelineEngine.eval_batch(return_logits / compute_loss=False / num_micro_batches / "
                          "reduce_output)", "zeal's eval_batch returns the mean loss of a step's micro-batches")
        return self.engine.eval_batch(data_iter)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop accumulated gradients."""
        self.engine.zero_grad()

    def train(self, mode: bool = True) -> DeepSpeedEngine:
        """Training mode (``nn.Module.train``)."""
        self.engine.train(mode)
        return super().train(mode)

    def eval(self) -> DeepSpeedEngine:
        """Evaluation mode."""
        return self.train(False)

    def to(self, *args: Any, **kwargs: Any) -> DeepSpeedEngine:
        """The engine itself when asked for its own device (scripts do
        ``engine.to(device)``); another device or a dtype is refused (ZeRO places the
        parameters; precision comes from the config)."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None or (device is not None and torch.device(device).type != self.device.type):
            raise Refused("DeepSpeedEngine.to(another device or dtype)", "ZeRO places the parameters at initialize "
                          "and precision comes from the config (fp16 / bf16)")
        return self

    def destroy(self) -> None:
        """Release the engine's collectives and buffers (it is unusable after)."""
        self.engine.close()

    # -- state and checkpoints -------------------------------------------------------------------
    def module_state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        """The whole model's state (full values; fp32 where zeal keeps masters), identical
        on every rank; every rank calls it."""
        state = self.engine.module_state_dict()
        if exclude_frozen_parameters:
            frozen = {n for n, q in self.module.named_parameters() if not q.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        out = destination if destination is not None else {}
        out.update({prefix + k: v for k, v in state.items()})
        return out

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> dict:
        """``module.``-prefixed keys over the whole model (as ``nn.Module.state_dict`` of
        DeepSpeed's engine names them), full values."""
        return self.module_state_dict(destination=destination, prefix=prefix + "module.")

    def load_module_state_dict(self, checkpoint: dict | None = None, strict: bool = True,
                               custom_load_fn: Any = None, fetch_z3_params: bool = False,
                               state_dict: dict | None = None) -> None:
        """Set the model from a whole-model state dict (``{"module": sd}`` or ``sd``); every
        rank calls it with the same values. ``strict``: the keys must match."""
        if custom_load_fn is not None:
            raise Refused("load_module_state_dict(custom_load_fn=...)", "load the values with GatheredParameters")
        sd = state_dict if state_dict is not None else checkpoint
        sd = sd.get("module", sd) if isinstance(sd, dict) else sd
        self._load_full(dict(sd), strict)

    def load_state_dict(self, state_dict: dict, strict: bool = True, assign: bool = False) -> Any:
        """Take back what :meth:`state_dict` gave (``module.`` keys, or the model's own)."""
        sd = {k[len("module."):] if k.startswith("module.") else k: v for k, v in state_dict.items()}
        return self._load_full(sd, strict)

    def _load_full(self, sd: dict, strict: bool) -> Any:
        from torch.nn.modules.module import _IncompatibleKeys

        from zeal.zero.sharded_state import set_full_values

        own = self.engine.module_state_dict()
        missing = sorted(set(own) - set(sd))
        unexpected = sorted(set(sd) - set(own))
        if strict and (missing or unexpected):
            raise RuntimeError(f"load_state_dict: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
        params = {n for n, _ in self.module.named_parameters()}
        set_full_values(self.engine, {k: v for k, v in sd.items() if k in params and k in own})
        with torch.no_grad():
            for name, buf in self.module.named_buffers():
                if name in sd:
                    buf.copy_(sd[name])
        return _IncompatibleKeys(missing, unexpected)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """The whole model's state (parameters in the compute dtype, buffers), on CPU, on
        rank 0 and None elsewhere; every rank calls it. ZeRO-3 only, as DeepSpeed's (a
        ValueError otherwise) — Hugging Face and accelerate save models with it."""
        if not self.zero_optimization_partition_weights():
            raise ValueError("this function requires ZeRO-3 mode")
        return self._consolidated_16bit_state_dict(exclude_frozen_parameters)

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """The whole model's state in the compute dtype on rank 0 (None elsewhere), any stage."""
        from collections import OrderedDict

        state = self.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
        if self.global_rank != 0:
            return None
        dtype = self.engine.compute_dtype
        params = {n for n, _ in self.module.named_parameters()}
        return OrderedDict((k, v.to(dtype) if k in params and v.is_floating_point() else v) for k, v in state.items())

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Write the whole model in the compute dtype to ``save_dir/save_filename`` from rank 0
        (``.safetensors``: safetensors); every rank calls it."""
        from zeal.deepspeed.saving import save_16bit

        return save_16bit(self.engine, save_dir, save_filename, exclude_frozen_parameters)

    def save_fp16_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's older name of :meth:`save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename)

    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Save under ``save_dir/tag`` (default ``global_step{N}``), replacing that tag if it
        exists (as DeepSpeed); every rank calls it. ``save_latest`` and
        ``exclude_frozen_parameters`` are accepted (zeal always records the latest tag and
        saves every parameter)."""
        from zeal.deepspeed.saving import save_replacing

        del save_latest, exclude_frozen_parameters
        tag = str(tag) if tag is not None else f"global_step{self.engine.global_steps}"
        save_replacing(self.engine, save_dir, tag, client_state or {})
        return True

    def load_checkpoint(self, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[str | None, dict | None]:
        """Load ``tag`` (default: the latest) and return ``(path, client_state)``; with no
        checkpoint there, ``(None, None)`` as in DeepSpeed. ``load_module_strict=False`` (the
        Trainer's resume of a PEFT model) loads as strict does: zeal's checkpoints hold every
        parameter, and one whose names differ from the model's is refused naming them. As
        DeepSpeed's, it leaves the random generators as they are (zeal's own load restores them)."""
        if custom_load_fn is not None:
            raise Refused("load_checkpoint(custom_load_fn=...)", "load with engine.load_checkpoint, then adjust "
                          "values with GatheredParameters")
        from zeal.deepspeed.saving import load_keeping_rng

        return load_keeping_rng(self.engine, load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
                                load_module_only)

    @classmethod
    def surface(cls, name: str) -> str:
        """``implemented`` / ``refused`` (a reason is named) / ``missing`` for DeepSpeed's engine name
        ``name`` (for ``bench/compat/ds_surface.py``)."""
        if name in _MOVES:
            return "refused"
        if hasattr(cls, name) or name in _DELEGATED or name in _ZERO_FIELDS or name in _FIXED or _flops_field(name):
            return "implemented"
        return "refused" if reason_by_prefix(name, _REASONS) is not None else "missing"


def _refusal(name: str) -> AttributeError:
    reason = reason_by_prefix(name, _REASONS)
    names = deepspeed_names()
    if reason is not None or name in names["engine"] or name in names["engine_from_nn_module"]:
        return Refused(f"DeepSpeedEngine.{name}", reason)
    return _NotDeepSpeed(f"'DeepSpeedEngine' object has no attribute {name!r}")


class _NotDeepSpeed(AttributeError):
    """A name neither zeal, DeepSpeed nor the model has: a plain AttributeError."""


class PipelineEngine(DeepSpeedEngine):
    """DeepSpeed's ``PipelineEngine``: what ``deepspeed.initialize`` returns when the model
    is a ``PipelineModule`` (or the config sets ``pipeline_parallel.size > 1``), so a
    script's ``isinstance(engine, deepspeed.PipelineEngine)`` test picks ``train_batch``."""

    def is_first_stage(self) -> bool:
        """Whether this rank holds the first pipeline stage (it reads the inputs)."""
        return self.engine.is_first_stage()

    def is_last_stage(self) -> bool:
        """Whether this rank holds the last pipeline stage (it computes the loss)."""
        return self.engine.is_last_stage()
