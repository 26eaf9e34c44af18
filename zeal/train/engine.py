"""The training engine: forward, backward, step — nothing else.

Everything the engine works with is built and wired by :mod:`zeal.train.build`;
the engine only sequences it. ``backward`` and ``step`` are called on every
micro-batch (as in DeepSpeed): ``backward`` scales the loss by 1/accumulation
(and by the fp16 loss scale), ``step`` updates only at the accumulation boundary.
What the applied features do around them (gradient reduction, stage-3 gathers, ...)
is a list of step hooks (:mod:`zeal.train.hooks`) walked in registration order.
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from zeal.config import Config
from zeal.dist.context import before_shutdown
from zeal.dist.mesh import Mesh
from zeal.precision.loss_scaler import LossScaler
from zeal.train.hooks import check_hook, run_hooks
from zeal.utils.timers import make_clock
from zeal.zero import sharded_state as zss
from zeal.zero.grad_sync import GradReducer
from zeal.zero.optimizer import ZeroOptimizer
from zeal.zero.param_coordinator import ParamCoordinator
from zeal.zero.sharded_state import Box, ParamInfo, ParamShard, ShardedState
from zeal.zero.units import FlatUnit

log = logging.getLogger("zeal")
_LIVE: weakref.WeakSet = weakref.WeakSet()


def _close_live_engines() -> None:
    for engine in list(_LIVE):
        engine.close()


before_shutdown(_close_live_engines)


def live_engines() -> list[TrainEngine]:
    """This process's engines that are not closed (where DeepSpeed's module-level helpers,
    ``deepspeed.zero.GatheredParameters`` and ``deepspeed.utils.groups``, find an engine)."""
    return [e for e in list(_LIVE) if "_p" in e.__dict__]


@dataclass
class EngineParts:
    """What build.py hands the engine (plain data)."""

    module: nn.Module
    config: Config
    mesh: Mesh
    units: list[FlatUnit]
    reducer: GradReducer
    zero_optimizer: ZeroOptimizer
    coordinator: ParamCoordinator | None
    scaler: LossScaler | None
    lr_scheduler: Any
    dataloader: Any
    compute_dtype: torch.dtype
    micro_batch: int
    grad_accum: int
    tensor_parallel: Any = None  # zeal.parallel.TensorParallel, or None
    comm_groups: list = field(default_factory=list)  # zeal.zero.groups.CommGroup: parameters not over mesh.dp
    sequence_parallel: Any = None  # zeal.parallel.sequence.SequenceParallel (runs the model at sp > 1), or None
    lora: Any = None  # the adapters (zeal.lora): engine.save_adapter, zeal.lora.engine.disable_adapters; or None
    token_drop: Any = None  # random-LTD's state (zeal.data.random_ltd.TokenDrop), or None when it is off


class TrainEngine:
    """``engine(batch)`` → loss; ``engine.backward(loss)``; ``engine.step()``.

    Invariant: between steps, every rank holds the same model values (replicated or
    as shards) and the same optimizer hyper-parameters; all ranks must call the
    same methods in the same order, since most of them communicate."""

    def __init__(self, parts: EngineParts) -> None:
        self._p = parts
        self.tensor_parallel = parts.tensor_parallel
        self.lora, self.token_drop = parts.lora, parts.token_drop
        self.module = parts.module
        self.config = parts.config
        self.lr_scheduler = parts.lr_scheduler
        self.dataloader = parts.dataloader
        self.global_steps = 0
        self.micro_steps = 0
        self._boundary_start = 0  # micro_steps at the last update
        self._boundary_override: bool | None = None
        self.global_samples = 0
        self._timing = parts.config.wall_clock_breakdown
        self._clock = make_clock(parts.mesh.device)  # CUDA events on CUDA (host calls only enqueue work)
        self.mesh = parts.mesh
        self.rank, self.world_size = parts.mesh.rank, parts.mesh.world_size
        self.device = parts.mesh.device
        self._hooks: list[object] = []
        # DeepSpeed's progress lines, when the config sets steps_per_print (zeal's default is silent)
        self._print_every = parts.config.steps_per_print if "steps_per_print" in parts.config.model_fields_set \
            else None
        self._step_losses: list[torch.Tensor] = []
        self._print_t0 = time.perf_counter()
        _LIVE.add(self)

    def register_step_hook(self, hook: object) -> None:
        """Run ``hook``'s ``before_backward(boundary)`` / ``after_backward()`` /
        ``after_step(applied)`` / ``close()`` (any subset; see :mod:`zeal.train.hooks`)
        after the hooks registered before it."""
        check_hook(hook)
        self._hooks.append(hook)

    def close(self) -> None:
        """Release hooks, in-flight collectives and buffers; the engine is unusable after.
        Called for every live engine at exit, before the process group is destroyed."""
        if self.__dict__.pop("_p", None) is None:
            return
        run_hooks(self._hooks, "close")

    # -- what the engine is set to, and where it is --------------------------------------
    # (DeepSpeed's names for these — get_lr(), train_batch_size(), ... — are the facade's:
    # zeal.deepspeed.engine_accessors)
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._p.zero_optimizer.optimizer

    @property
    def zero_stage(self) -> int:
        return self.config.zero_optimization.stage

    @property
    def micro_batch(self) -> int:
        """Samples per rank per forward; settable between steps (>= 1), as DeepSpeed's
        ``set_train_micro_batch_size`` (the accumulation steps stay)."""
        return self._p.micro_batch

    @micro_batch.setter
    def micro_batch(self, value: int) -> None:
        if value < 1:
            raise ValueError(f"micro_batch must be >= 1, got {value!r}")
        self._p.micro_batch = value

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step; settable between steps (>= 1), as DeepSpeed's
        ``set_train_batch_size`` (a running accumulation counts to the new number)."""
        return self._p.grad_accum

    @grad_accum.setter
    def grad_accum(self, value: int) -> None:
        if value < 1:
            raise ValueError(f"grad_accum must be >= 1, got {value!r}")
        self._p.grad_accum = value

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the model runs in (floating point inputs are cast to it)."""
        return self._p.compute_dtype

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped (an fp16 overflow)."""
        return self._p.zero_optimizer.skipped_steps

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without one)."""
        return self._p.scaler.scale if self._p.scaler else 1.0

    @property
    def grad_norm(self) -> float | None:
        """Norm of the (unscaled, unclipped) mean gradient at the last step."""
        return self._p.zero_optimizer.last_grad_norm

    @property
    def at_boundary(self) -> bool:
        """Whether the current micro-step ends the accumulation (then ``step`` updates)."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps - self._boundary_start + 1) % self._p.grad_accum == 0

    def set_boundary(self, is_boundary: bool) -> None:
        """Override the count: the current micro-step (until ``step``) ends the
        accumulation, or does not, whatever ``grad_accum`` says — for loops whose last
        accumulation of an epoch is shorter (Hugging Face's Trainer). Call it before
        ``backward``; the loss is then the caller's to scale."""
        self._boundary_override = bool(is_boundary)

    def restore_progress(self, global_steps: int, micro_steps: int, global_samples: int) -> None:
        """Set the step counters to a checkpoint's (zeal.checkpoint's load). Checkpoints are
        saved right after an update, so the next micro-step starts an accumulation."""
        self.global_steps, self.micro_steps, self.global_samples = global_steps, micro_steps, global_samples
        self._boundary_start = micro_steps

    def train(self, mode: bool = True) -> TrainEngine:
        self.module.train(mode)
        return self

    def eval(self) -> TrainEngine:
        return self.train(False)

    # -- the loop ------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model on this rank's inputs (moved to the device, floating point ones
        cast to the compute dtype). As DeepSpeed's engine, ``engine(*args, **kwargs)``
        calls ``model(*args, **kwargs)``; a lone positional batch is unpacked:
        a dict → ``model(**batch)``, a tuple or list → ``model(*batch)``."""
        t0 = self._mark()
        args, kwargs = self._to_device(args), self._to_device(kwargs)
        run = self._p.sequence_parallel or self.module  # under sp: this rank's chunk, the whole loss
        if len(args) == 1 and isinstance(args[0], dict):
            out = run(**args[0], **kwargs)
        elif len(args) == 1 and isinstance(args[0], (tuple, list)):
            out = run(*args[0], **kwargs)
        else:
            out = run(*args, **kwargs)
        self._tick("forward", t0)
        return out

    def backward(self, loss: Any, retain_graph: bool = False, scale_wrt_gas: bool = True) -> None:
        """Back-propagate ``loss`` (a tensor, or an output object with ``.loss``), divided
        by the accumulation steps unless ``scale_wrt_gas`` is false (DeepSpeed's keywords)."""
        if not isinstance(loss, torch.Tensor):
            loss = getattr(loss, "loss", None)
            if loss is None:
                raise TypeError("engine.backward needs a loss tensor or an output with a .loss attribute")
        t0 = self._mark()
        p = self._p
        run_hooks(self._hooks, "before_backward", self.at_boundary)
        scale = (p.scaler.scale if p.scaler else 1.0) / (p.grad_accum if scale_wrt_gas else 1)
        if self._print_every is not None and self.rank == 0:
            self._step_losses.append(loss.detach())
        (loss.float() * scale).backward(retain_graph=retain_graph)
        t1 = self._mark()
        run_hooks(self._hooks, "after_backward")
        self._tick("backward", t0, t1)
        self._tick("reduce", t1)

    def step(self) -> None:
        """Count the micro-step; at the accumulation boundary update the model."""
        boundary = self.at_boundary
        self._boundary_override = None
        self.micro_steps += 1
        self.global_samples += self._p.micro_batch * self.mesh.data_size
        if not boundary:
            return
        self._boundary_start = self.micro_steps
        t0 = self._mark()
        p = self._p
        applied = p.zero_optimizer.step()
        run_hooks(self._hooks, "after_step", applied)
        if applied and self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.global_steps += 1
        self.mesh.stats.end_step()
        self._tick("step", t0)
        if self.rank == 0 and self._print_every is not None:
            if self.global_steps % self._print_every == 0:
                self._report_progress()
            self._step_losses.clear()

    def _report_progress(self) -> None:
        """DeepSpeed's two progress lines, on rank 0 every ``steps_per_print`` steps:
        ``[Rank 0] step=S, skipped=K, lr=[...], mom=[...]`` and ``steps: S loss: L iter time
        (s): T samples/sec: R`` (L: this rank's mean loss over the step's micro-batches, as
        passed to ``backward``; T: wall time per step since the last print)."""
        now = time.perf_counter()
        iter_time = (now - self._print_t0) / self._print_every
        self._print_t0 = now
        groups = self.optimizer.param_groups
        lr = [g["lr"] for g in groups]
        mom = [g["betas"] if "betas" in g else g.get("momentum") for g in groups]  # Adam's betas, else SGD's
        print(f"[Rank 0] step={self.global_steps}, skipped={self.skipped_steps}, lr={lr}, mom={mom}", flush=True)
        if self._step_losses:
            loss = float(torch.stack([x.float() for x in self._step_losses]).mean())
            samples = self._p.micro_batch * self._p.grad_accum * self.mesh.data_size
            print(f"steps: {self.global_steps} loss: {loss:0.4f} iter time (s): {iter_time:0.3f} "
                  f"samples/sec: {samples / max(iter_time, 1e-9):0.3f}", flush=True)

    def zero_grad(self) -> None:
        """Drop accumulated gradients (they are also dropped after every step)."""
        self._p.reducer.zero()

    # -- reports ---------------------------------------------------------------------------
    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds persistently for parameters (trainable, in flat units),
        gradients and optimizer state (separate fp32 masters + optimizer moments; with
        nvme offload, the swap buffer pool). Transient gathered copies (ZeRO-3), frozen
        parameters, and what lives on disk are reported apart."""
        p = self._p
        params = 0
        gathered = 0
        home = p.coordinator.coll.home if p.coordinator is not None else None
        on_disk = home is not None and home.on_disk
        off_device = home is not None and home.lends  # host memory or disk: no device bytes
        for u in p.units:
            if not u.trainable:
                continue
            if u.partitioned:
                params += (0 if off_device else u.nbytes_shard()) + (u.padded * u.full.element_size() if u.persistent else 0)
                if u.gathered and not u.persistent:
                    gathered += u.padded * u.full.element_size()
            else:
                params += u.padded * u.full.element_size()
        frozen = sum(
            ((0 if off_device else u.nbytes_shard()) if u.partitioned else u.padded * u.full.element_size())
            for u in p.units if not u.trainable
        )
        out = {
            "params": params,
            "grads": p.reducer.nbytes(),
            "optimizer": p.zero_optimizer.nbytes(),
            "gathered_now": gathered,
            "frozen": frozen,
        }
        out["total"] = out["params"] + out["grads"] + out["optimizer"]
        out["grad_buffers"] = p.reducer.buffer_nbytes()  # reused reduction buffers, not gradients
        # the other tiers (ZeRO-Offload / ZeRO-Infinity)
        out["param_swap_buffers"] = home.cpu_bytes(p.units) if on_disk else 0
        out["params_disk"] = home.disk_bytes() if on_disk else 0
        disk = getattr(p.zero_optimizer, "disk_bytes", None)
        out["optimizer_disk"] = disk() if disk else 0
        return out

    def comm_stats(self) -> dict:
        """Bytes and calls per collective for the last optimizer step and in total, by
        op, kind and mesh dimension (convention in :mod:`zeal.dist.comm`); every
        collective zeal issues goes through the mesh's Comms, so nothing is missing."""
        return self.mesh.stats.report()

    def wall_clock_breakdown(self) -> dict[str, float]:
        """Seconds spent in forward, backward, reduce (waiting for gradient
        collectives), step and gather (waiting for ZeRO-3 all-gathers), in total."""
        out = self._clock.totals()
        if self._p.coordinator is not None:
            out["gather"] = self._p.coordinator.gather_time
        return out

    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[None]:
        """Full parameters on every rank inside the block (a no-op below stage 3)."""
        if self._p.coordinator is None:
            yield
        else:
            with self._p.coordinator.gathered():
                yield

    def iter_gathered_parameters(self, only: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, full parameter)`` of the whole model, every rank together; at stage 3
        one unit is gathered at a time (released once the caller moves past it), so a
        weight sync never holds the whole model twice. Values are valid only until the
        next item is asked for. ``only``: just these names (at stage 3 only their units are gathered)."""
        if self._p.coordinator is None:
            yield from ((n, p) for n, p in self.module.named_parameters() if only is None or n in only)
            return
        for named in self._p.coordinator.gathered_one_by_one(only):
            yield from ((n, p) for n, p in named if only is None or n in only)

    def module_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model state (parameters in fp32 from the masters where they exist,
        plus buffers; every MoE expert of every ep rank), on CPU, identical on every rank."""
        with torch.no_grad(), self.gathered_parameters():
            state = {k: v.detach().float().cpu().clone() if v.is_floating_point() else v.detach().cpu().clone()
                     for k, v in self.module.state_dict().items()}
        tp = getattr(self, "tensor_parallel", None)
        if tp is not None:  # whole tensors from every tp rank's slices
            from zeal.parallel.tensor import gather_full

            state = gather_full(tp, state)
        if self.mesh.ep_size > 1:  # every expert, from every ep rank
            from zeal.moe.layout import gather_experts

            state = gather_experts(self.mesh.ep, state, self.module)
        return state

    def save_adapter(self, path: str) -> str:
        """Write the LoRA adapter as a PEFT folder (``adapter_config.json`` +
        ``adapter_model.safetensors``); every rank must call it (see :mod:`zeal.lora.engine`)."""
        from zeal.lora.engine import save_adapter

        return str(save_adapter(self, path))

    # -- sharded state and checkpoints ----------------------------------------------------
    def sharded_state(self) -> contextlib.AbstractContextManager[ShardedState]:
        """``with engine.sharded_state() as st:`` — the boxes of every parameter this rank
        owns, with master values and optimizer state (views, read-only); see
        :mod:`zeal.zero.sharded_state`."""
        return zss.sharded_state(self)

    def load_sharded_state(self, read: Callable[[ParamInfo, Box], ParamShard], *, load_optimizer: bool = True,
                           skipped_steps: int | None = None, loss_scaler: dict | None = None) -> None:
        """Set every box this rank holds from ``read(info, box)`` and re-synchronise the
        model (all ranks together); see :func:`zeal.zero.sharded_state.load_sharded_state`."""
        zss.load_sharded_state(self, read, load_optimizer=load_optimizer, skipped_steps=skipped_steps,
                               loss_scaler=loss_scaler)

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None) -> str:
        from zeal import checkpoint

        return checkpoint.save(self, save_dir, tag=tag, client_state=client_state)

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False) -> dict:
        from zeal import checkpoint

        client = checkpoint.load(self, load_dir, tag=tag, load_optimizer_states=load_optimizer_states,
                                 load_lr_scheduler_states=load_lr_scheduler_states,
                                 load_module_only=load_module_only)
        sampler = getattr(self.dataloader, "sampler", None)
        if hasattr(sampler, "set_position"):  # the data position follows from the samples consumed
            sampler.set_position(self.global_samples)
        return client

    # -- helpers -----------------------------------------------------------------------------
    def _to_device(self, batch: Any) -> Any:
        if isinstance(batch, torch.Tensor):
            b = batch.to(self.device, non_blocking=True)
            if b.is_floating_point() and b.dtype != self._p.compute_dtype:
                b = b.to(self._p.compute_dtype)
            return b
        if isinstance(batch, dict):
            return {k: self._to_device(v) for k, v in batch.items()}
        if isinstance(batch, (list, tuple)):
            return type(batch)(self._to_device(v) for v in batch)
        return batch

    def _mark(self) -> Any:
        return self._clock.mark() if self._timing else None

    def _tick(self, name: str, t0: Any, t1: Any = None) -> None:
        if self._timing:
            self._clock.add(name, t0, t1)
