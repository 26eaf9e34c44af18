"""DeepSpeed's learning-rate schedules as pure functions of the step, plus a small
scheduler object that applies one to an optimizer once per optimizer step."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

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


def lr_range_test_lr(step: int, lr_range_test_min_lr: float = 0.001, lr_range_test_step_size: int = 2000,
                     lr_range_test_step_rate: float = 1.0, lr_range_test_staircase: bool = False) -> float:
    """LRRangeTest: ``min_lr · (1 + step_rate · step / step_size)``, the interval floored
    when ``staircase`` (the LR keeps growing: run it to find the largest stable LR)."""
    interval = step / max(1, lr_range_test_step_size)
    if lr_range_test_staircase:
        interval = math.floor(interval)
    return lr_range_test_min_lr * (1.0 + lr_range_test_step_rate * interval)


@dataclass(frozen=True)
class OneCycle:
    """DeepSpeed's OneCycle: LR rises from ``cycle_min_lr`` to ``cycle_max_lr`` over
    ``cycle_first_step_size`` steps and falls back over ``cycle_second_step_size``
    (default: the first), momentum moving the opposite way between ``cycle_max_mom`` and
    ``cycle_min_mom``; after the cycle, LR decays as ``cycle_min_lr / (1 + decay_lr_rate ·
    k / decay_step_size)`` and momentum grows by ``(1 + decay_mom_rate · k /
    decay_step_size)`` (k steps past the cycle). Stair counts > 0 change LR and momentum
    in that many equal stairs per half-cycle."""

    cycle_min_lr: float
    cycle_max_lr: float
    decay_lr_rate: float = 0.0
    cycle_first_step_size: int = 2000
    cycle_second_step_size: int | None = None
    cycle_first_stair_count: int = 0
    cycle_second_stair_count: int | None = None
    decay_step_size: int = 0
    cycle_momentum: bool = True
    cycle_min_mom: float = 0.8
    cycle_max_mom: float = 0.9
    decay_mom_rate: float = 0.0

    def _scale(self, step: int) -> float | None:
        """Where in the cycle ``step`` is, 0 (bottom) … 1 (top); None after the cycle."""
        first = max(1, self.cycle_first_step_size)
        second = max(1, self.cycle_second_step_size if self.cycle_second_step_size is not None else first)
        if step >= first + second:
            return None
        if step <= first:
            frac, stairs = step / first, self.cycle_first_stair_count
        else:
            frac = 1.0 - (step - first) / second
            stairs = self.cycle_second_stair_count if self.cycle_second_stair_count is not None \
                else self.cycle_first_stair_count
        return math.floor(frac * stairs) / stairs if stairs and stairs > 0 else frac

    def _decay_interval(self, step: int) -> float:
        first = max(1, self.cycle_first_step_size)
        second = max(1, self.cycle_second_step_size if self.cycle_second_step_size is not None else first)
        past = step - (first + second) + 1
        return past / self.decay_step_size if self.decay_step_size > 0 else 0.0

    def lr(self, step: int) -> float:
        """The learning rate after ``step`` optimizer steps."""
        s = self._scale(step)
        if s is not None:
            return self.cycle_min_lr + (self.cycle_max_lr - self.cycle_min_lr) * s
        return self.cycle_min_lr / (1.0 + self.decay_lr_rate * self._decay_interval(step))

    def momentum(self, step: int) -> float | None:
        """Momentum (SGD) or beta1 (Adam) after ``step`` steps; None when not cycled."""
        if not self.cycle_momentum:
            return None
        s = self._scale(step)
        if s is not None:
            return self.cycle_max_mom - (self.cycle_max_mom - self.cycle_min_mom) * s
        return self.cycle_max_mom * (1.0 + self.decay_mom_rate * self._decay_interval(step))


class StepScheduler:
    """Sets every param group's lr to ``lr_at(step, base_lr)`` after each optimizer step."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr_at: Callable[[int, float], float],
                 momentum_at: Callable[[int], float | None] | None = None) -> None:
        self.optimizer = optimizer
        self.lr_at = lr_at
        self.momentum_at = momentum_at
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self.last_step = 0
        self._apply()

    def _apply(self) -> None:
        mom = self.momentum_at(self.last_step) if self.momentum_at is not None else None
        for g, base in zip(self.optimizer.param_groups, self.base_lrs):
            g["lr"] = self.lr_at(self.last_step, base)
            if mom is not None and "betas" in g:
                g["betas"] = (mom, *tuple(g["betas"])[1:])
            elif mom is not None and "momentum" in g:
                g["momentum"] = mom

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
    import dataclasses
    import inspect

    if kind == "OneCycle":
        allowed = {f.name for f in dataclasses.fields(OneCycle)}
    else:
        probe = {"WarmupLR": warmup_lr, "WarmupDecayLR": warmup_decay_lr, "WarmupCosineLR": warmup_cosine_ratio,
                 "LRRangeTest": lr_range_test_lr}[kind]
        allowed = set(inspect.signature(probe).parameters) - {"step"}
    bad = sorted(set(params) - allowed)
    if bad:
        raise ValueError(f"config key 'scheduler.params.{bad[0]}': unknown parameter for {kind} "
                         f"(known: {', '.join(sorted(allowed))})")
    if kind in ("WarmupDecayLR", "WarmupCosineLR") and "total_num_steps" not in params:
        raise ValueError(f"config key 'scheduler.params.total_num_steps' is required for {kind}")
    check_scheduler_params(kind, params)  # ranges (again: the dict may have changed after validation)
    if kind == "OneCycle":
        for key in ("cycle_min_lr", "cycle_max_lr"):
            if key not in params:
                raise ValueError(f"config key 'scheduler.params.{key}' is required for OneCycle")
        cycle = OneCycle(**params)
        return StepScheduler(optimizer, lambda s, base: cycle.lr(s), cycle.momentum)
    fns = {
        "WarmupLR": lambda s, base: warmup_lr(s, **params),
        "WarmupDecayLR": lambda s, base: warmup_decay_lr(s, **params),
        "WarmupCosineLR": lambda s, base: base * warmup_cosine_ratio(s, **params),
        "LRRangeTest": lambda s, base: lr_range_test_lr(s, **params),
    }
    return StepScheduler(optimizer, fns[kind])
