"""Hugging Face ``Trainer`` training through zeal's engine.

``ZealTrainer`` keeps ``Trainer``'s loop, data loading, logging and callbacks, and hands
the model's forward, backward, gradient accumulation, clipping, optimizer step and LR
schedule to a zeal engine built from a DeepSpeed-style config::

    from zeal.integrations.transformers import ZealTrainer
    trainer = ZealTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                          zeal_config=ds_config_dict_or_path)
    trainer.train()

The config's ``"auto"`` values are taken from ``TrainingArguments`` as Hugging Face's
DeepSpeed integration fills them (per-device batch size, gradient accumulation, learning
rate, Adam betas/eps, weight decay, ``max_grad_norm``, warm-up/total steps, fp16/bf16).
The engine is built lazily when training starts (``create_optimizer``); ``Trainer`` then
sees a stand-in optimizer and scheduler whose ``step`` do nothing, and its own clipping
is replaced by the engine's gradient norm. ``save_model`` writes a Hugging Face folder
of the full (gathered) weights; checkpoints during training are zeal checkpoints (plus
``trainer_state.json``) that ``train(resume_from_checkpoint=...)`` loads.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from transformers import Trainer

import zeal
from zeal.config import AutoValues, load_config

__all__ = ["ZealTrainer", "auto_values_from_args"]


def auto_values_from_args(args: Any, num_training_steps: int | None = None,
                          hidden_size: int | None = None) -> AutoValues:
    """zeal's :class:`AutoValues` from ``TrainingArguments`` (what HF's DeepSpeed
    integration puts into a config's ``"auto"`` entries)."""
    warmup = args.get_warmup_steps(num_training_steps) if num_training_steps else None
    return AutoValues(
        micro_batch=args.per_device_train_batch_size, grad_accum=args.gradient_accumulation_steps,
        lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
        weight_decay=args.weight_decay, gradient_clipping=args.max_grad_norm, fp16=bool(args.fp16),
        bf16=bool(args.bf16), warmup_steps=warmup, total_steps=num_training_steps, hidden_size=hidden_size)


class _EngineOptimizer:
    """What ``Trainer`` holds as its optimizer: the engine's param groups; ``step`` and
    ``zero_grad`` do nothing (the engine steps at its accumulation boundary)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @property
    def param_groups(self) -> list[dict]:
        return self.engine.optimizer.param_groups

    @property
    def state(self) -> dict:
        return self.engine.optimizer.state

    def step(self, closure: Any = None) -> None:
        """The engine has already stepped (in ``training_step``)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The engine drops its gradients after every step."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Optimizer state is restored by the engine's checkpoint."""


def _lrs(engine: Any) -> list[float]:
    """The learning rate of every param group of zeal's ``engine``."""
    return [g["lr"] for g in engine.optimizer.param_groups]


class _EngineScheduler:
    """What ``Trainer`` holds as its LR scheduler: ``get_last_lr`` reports the lr of the
    engine's last update; ``step`` does nothing (the engine owns the schedule)."""

    def __init__(self, trainer: ZealTrainer) -> None:
        self.trainer = trainer

    def get_last_lr(self) -> list[float]:
        return self.trainer._zeal_last_lr or _lrs(self.trainer.zeal_engine)

    def step(self, *args: Any, **kwargs: Any) -> None:
        """The engine's scheduler has already stepped."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """The schedule is restored by the engine's checkpoint."""


class _EngineModule(nn.Module):
    """What ``Trainer`` holds as its wrapped model (where DDP would be): the model as
    ``.module`` (``unwrap_model`` finds it there), calls and modes through the engine."""

    def __init__(self, engine: Any) -> None:
        super().__init__()
        self.module = engine.module
        object.__setattr__(self, "engine", engine)  # not a submodule

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def train(self, mode: bool = True) -> _EngineModule:
        self.engine.train(mode)
        return super().train(mode)


class ZealTrainer(Trainer):
    """A ``Trainer`` whose forward/backward/step run through a zeal engine.

    ``zeal_config``: a DeepSpeed-style config (dict or JSON path; ZeRO stages 0-3) whose
    ``"auto"`` values come from ``args``. Other arguments are ``Trainer``'s. The engine is
    built on the first ``train`` call and is available as ``trainer.zeal_engine``."""

    def __init__(self, *args: Any, zeal_config: dict | str | os.PathLike | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.zeal_config = zeal_config if zeal_config is not None else {}
        self.zeal_engine: Any = None
        self._zeal_last_lr: list[float] | None = None
        self._zeal_total_steps: int | None = None

    # -- building the engine -----------------------------------------------------------
    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        self._zeal_total_steps = num_training_steps
        self.create_optimizer()
        self.create_scheduler(num_training_steps)

    def create_optimizer(self, model: Any = None) -> Any:
        """Build the zeal engine over ``self.model`` (once) and return the stand-in optimizer.
        Parameters are split as Trainer's default optimizer does: no weight decay on biases
        and norm weights."""
        if self.zeal_engine is None:
            model = self.model
            total = self._zeal_total_steps or self.args.max_steps
            hidden = getattr(getattr(model, "config", None), "hidden_size", None)
            auto = auto_values_from_args(self.args, total if total and total > 0 else None, hidden)
            decay = set(self.get_decay_parameter_names(model))
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            groups = [{"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                      {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
            groups = [g for g in groups if g["params"]]
            self.zeal_engine = zeal.initialize(model, load_config(self.zeal_config, auto), model_parameters=groups)
        if self.optimizer is None or not isinstance(self.optimizer, _EngineOptimizer):
            self.optimizer = _EngineOptimizer(self.zeal_engine)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """The stand-in scheduler (the engine's config owns the schedule)."""
        if self._zeal_total_steps is None:
            self._zeal_total_steps = num_training_steps
        if not isinstance(self.lr_scheduler, _EngineScheduler):
            self.lr_scheduler = _EngineScheduler(self)
        return self.lr_scheduler

    def _wrap_model(self, model: Any, training: bool = True, dataloader: Any = None) -> Any:
        """The engine stands where ``Trainer`` would put DDP: accelerate then never wraps the
        model (zeal reduces gradients itself, and a DDP wrapper re-homes the parameters zeal
        keeps in its flat buffers), and evaluation runs through the engine (under stage 3 it
        gathers the partitioned parameters)."""
        if self.zeal_engine is None:
            return super()._wrap_model(model, training, dataloader)
        if not isinstance(self.model_wrapped, _EngineModule):
            self.model_wrapped = _EngineModule(self.zeal_engine)
        return self.model_wrapped

    # -- the step ------------------------------------------------------------------------
    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        """Forward through the engine, ``engine.backward``, ``engine.step`` (which updates
        at the accumulation boundary). The loss is scaled for accumulation exactly as
        ``Trainer`` does (once, here), and returned detached for logging."""
        engine = self.zeal_engine
        engine.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(engine, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        if self.args.n_gpu > 1:
            loss = loss.mean()
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) \
                or self.compute_loss_func is not None
        if not scaled:
            loss = loss / self.current_gradient_accumulation_steps
        # Trainer ends an epoch's last accumulation early (fewer micro-batches); follow it.
        engine.set_boundary(self.accelerator.sync_gradients)
        engine.backward(loss, scale_wrt_gas=False)
        if engine.at_boundary:
            self._zeal_last_lr = _lrs(engine)
        engine.step()
        return loss.detach()

    def _clip_grad_norm(self, model: Any) -> Any:
        """The engine clips (``gradient_clipping``); report its pre-clip norm."""
        return self.zeal_engine.grad_norm

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        norm = self.zeal_engine.grad_norm
        return float(norm) if norm is not None else None

    # -- saving and resuming -------------------------------------------------------------
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """A Hugging Face folder with the full weights gathered from the engine."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.zeal_engine is None:
            return super()._save(output_dir, state_dict)
        state = self.zeal_engine.module_state_dict()
        if not self.args.should_save:
            return None
        os.makedirs(output_dir, exist_ok=True)
        self.model.save_pretrained(output_dir, state_dict=state)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
        return None

    def _save_checkpoint(self, model: Any, trial: Any = None) -> None:
        """``checkpoint-<step>``: the engine's checkpoint (all ranks), the trainer state
        and RNG state, as ``Trainer.train(resume_from_checkpoint=...)`` reads them."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

        run_dir = self._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        self.zeal_engine.save_checkpoint(output_dir)
        self._save_rng_state(output_dir)
        if self.args.should_save:
            self.state.save_to_json(os.path.join(output_dir, "trainer_state.json"))
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Weights are loaded with the optimizer state from the engine's checkpoint."""

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is not None:
            self.zeal_engine.load_checkpoint(checkpoint)

    def _load_scaler(self, checkpoint: str | None) -> None:
        """The loss scaler is part of the engine's checkpoint."""
