"""DeepSpeed's learning-rate schedules as pure functions of the step, plus a small
scheduler object that applies one to an optimizer once per optimizer step."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from zeal.config.schema import check_scheduler_params


def warmup_factor(step: int, warmup_num_steps: int, warmup_type: str) -> float:
    """Fraction of warm-up done at ``step`` (1.0 when finished): log or linear."""
    if warmup_num_steps <= 0 or step >= warmup_num_steps:
        return 1.0
    if warmup_type == "log":  # log(1) = 0 would divide by zero: a 1-step warm-up counts as 2
        return math.log(step + 1) / math.log(max(2, warmup_num_steps))
    return step / warmup_num_steps


def warmup_lr(step: int, warmup_min_lr: float = 0.0, warmup_max_lr: float = 0.001,
              warmup_num_steps: int = 1000, warmup_type: str = "log") -> float:
    """WarmupLR: min → max over the warm-up, then constant."""
    f = warmup_factor(step, warmup_num_steps, warmup_type)
    return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * f


def warmup_decay_lr(step: int, total_num_steps: int, warmup_min_lr: float = 0.0, warmup_max_lr: float = 0.001,
                    warmup_num_steps: int = 1000, warmup_type: str = "log") -> float:
    """WarmupDecayLR: warm-up as WarmupLR, then linear decay to 0 at total_num_steps."""
    if step < warmup_num_steps:
        return warmup_lr(step, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)
    frac = max(0.0, (total_num_steps - step) / max(1.0, total_num_steps - warmup_num_steps))
    return warmup_max_lr * frac


def warmup_cosine_ratio(step: int, total_num_steps: int, warmup_min_ratio: float = 0.0,
                        warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                        warmup_type: str = "log") -> float:
    """WarmupCosineLR: a multiplier of the optimizer's base lr."""
    if step < warmup_num_steps:
        f = warmup_factor(step, warmup_num_steps, warmup_type)
        return warmup_min_ratio + (1.0 - warmup_min_ratio) * f
    progress = min(1.0, (step - warmup_num_steps) / max(1, total_num_steps - warmup_num_steps))
    return cos_min_ratio + (1.0 - cos_min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class StepScheduler:
    """Sets every param group's lr to ``lr_at(step, base_lr)`` after each optimizer step."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr_at: Callable[[int, float], float]) -> None:
        self.optimizer = optimizer
        self.lr_at = lr_at
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self.last_step = 0
        self._apply()

    def _apply(self) -> None:
        for g, base in zip(self.optimizer.param_groups, self.base_lrs):
            g["lr"] = self.lr_at(self.last_step, base)

    def step(self) -> None:
        self.last_step += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"last_step": self.last_step, "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, sd: dict) -> None:
        self.last_step = int(sd["last_step"])
        self.base_lrs = list(sd["base_lrs"])
        self._apply()


def build_scheduler(kind: str, params: dict, optimizer: torch.optim.Optimizer) -> StepScheduler:
    """Build a schedule from its DeepSpeed name and params; unknown params and values out
    of range are a ValueError naming ``scheduler.params.<key>``."""
    fns = {
        "WarmupLR": lambda s, base: warmup_lr(s, **params),
        "WarmupDecayLR": lambda s, base: warmup_decay_lr(s, **params),
        "WarmupCosineLR": lambda s, base: base * warmup_cosine_ratio(s, **params),
    }
    probe = {"WarmupLR": warmup_lr, "WarmupDecayLR": warmup_decay_lr, "WarmupCosineLR": warmup_cosine_ratio}[kind]
    import inspect

    allowed = set(inspect.signature(probe).parameters) - {"step"}
    bad = sorted(set(params) - allowed)
    if bad:
        raise ValueError(f"config key 'scheduler.params.{bad[0]}': unknown parameter for {kind} "
                         f"(known: {', '.join(sorted(allowed))})")
    if kind in ("WarmupDecayLR", "WarmupCosineLR") and "total_num_steps" not in params:
        raise ValueError(f"config key 'scheduler.params.total_num_steps' is required for {kind}")
    check_scheduler_params(kind, params)  # ranges (again: the dict may have changed after validation)
    return StepScheduler(optimizer, fns[kind])
