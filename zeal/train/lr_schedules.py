"""DeepSpeed's learning-rate schedules as pure functions of the step, plus a small
scheduler object that applies one to an optimizer once per optimizer step."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from zeal.config.schema import check_scheduler_params


def _index(step: int, warmup_num_steps: int) -> tuple[int, int]:
    """(batch index, warm-up length) as DeepSpeed's schedules see them after ``step``
    optimizer steps: index ``step - 1`` (they set the next update's lr from the batch just
    done) and at least 2 warm-up steps (a 1-step log warm-up would divide by log 1).
    ``warmup_num_steps`` 0, which DeepSpeed refuses, means no warm-up at all: index
    ``step`` and length 0, Hugging Face's schedules without warm-up."""
    if warmup_num_steps <= 0:
        return step, 0
    return step - 1, max(2, int(warmup_num_steps))


def warmup_factor(step: int, warmup_num_steps: int, warmup_type: str) -> float:
    """Fraction of warm-up done for the update that follows ``step`` optimizer steps (0.0
    before the first; 1.0 when finished). As DeepSpeed's schedules, the first two updates
    both run at the start of the warm-up: log ``ln(step) / ln(W)``, linear ``(step - 1) /
    W``, with ``W = max(2, warmup_num_steps)``."""
    last, w = _index(step, warmup_num_steps)
    if last < 0:
        return 0.0
    if last >= w:
        return 1.0
    if warmup_type == "log":
        return math.log(last + 1) / math.log(w)
    return last / w


def warmup_lr(step: int, warmup_min_lr: float = 0.0, warmup_max_lr: float | None = None,
              warmup_num_steps: int = 1000, warmup_type: str = "log", base_lr: float | None = None) -> float:
    """WarmupLR: min → max over the warm-up, then constant (``warmup_max_lr=None``: the
    optimizer's own lr ``base_lr``, as DeepSpeed)."""
    top = warmup_max_lr if warmup_max_lr is not None else base_lr
    if top is None:
        raise ValueError("warmup_lr: warmup_max_lr is None and no base_lr was given")
    return warmup_min_lr + (top - warmup_min_lr) * warmup_factor(step, warmup_num_steps, warmup_type)


def warmup_decay_lr(step: int, total_num_steps: int, warmup_min_lr: float = 0.0, warmup_max_lr: float = 0.001,
                    warmup_num_steps: int = 1000, warmup_type: str = "log") -> float:
    """WarmupDecayLR: warm-up as WarmupLR, then linear decay from max back to min, reached
    at ``total_num_steps`` (DeepSpeed's ``min + (max - min) · (T - i) / (T - W)`` with
    ``i = step - 1`` the index of the batch just done)."""
    last, w = _index(step, warmup_num_steps)
    if last < w:
        return warmup_lr(step, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)
    gamma = max(0.0, float(total_num_steps - last) / float(max(1.0, total_num_steps - w)))
    return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma


def warmup_cosine_ratio(step: int, total_num_steps: int, warmup_min_ratio: float = 0.0,
                        warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                        warmup_type: str = "log") -> float:
    """WarmupCosineLR: a multiplier of the optimizer's base lr — 0 for the first update
    (DeepSpeed's value before its first step), then the warm-up from ``warmup_min_ratio``
    to 1, then a cosine down to ``cos_min_ratio`` over ``total_num_steps - W``, held there."""
    last, w = _index(step, warmup_num_steps)
    if w == 0:  # no warm-up: the cosine starts at the first update
        progress = min(1.0, step / max(1, total_num_steps))
    elif last < 0:
        return 0.0
    elif last < w:
        f = warmup_factor(step, warmup_num_steps, warmup_type)
        return warmup_min_ratio + (1.0 - warmup_min_ratio) * f
    else:
        progress = min(1.0, (last - w + 1) / max(1, total_num_steps - w))
    return max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)


def lr_range_test_lr(step: int, lr_range_test_min_lr: float = 0.001, lr_range_test_step_size: int = 2000,
                     lr_range_test_step_rate: float = 1.0, lr_range_test_staircase: bool = False) -> float:
    """LRRangeTest: ``min_lr · (1 + step_rate · step / step_size)``, the interval floored
    when ``staircase`` (the LR keeps growing: run it to find the largest stable LR)."""
    interval = step / max(1, lr_range_test_step_size)
    if lr_range_test_staircase:
        interval = math.floor(interval)
    return lr_range_test_min_lr * (1.0 + lr_range_test_step_rate * interval)


# DeepSpeed's OneCycle sets Adam's betas to (momentum, 0.99) whenever it cycles momentum.
ONE_CYCLE_BETA2 = 0.99


@dataclass(frozen=True)
class OneCycle:
    """DeepSpeed's OneCycle: LR rises from ``cycle_min_lr`` to ``cycle_max_lr`` over
    ``cycle_first_step_size`` steps and falls back over ``cycle_second_step_size``
    (default: the first), momentum moving the opposite way between ``cycle_max_mom`` and
    ``cycle_min_mom``; after the cycle, LR decays as ``cycle_min_lr / (1 + decay_lr_rate ·
    k / decay_step_size)`` and momentum grows by ``(1 + decay_mom_rate · k /
    decay_step_size)`` (k steps past the cycle). Stair counts > 0 change LR and momentum
    in that many equal stairs per half-cycle. As DeepSpeed, the first update runs at
    ``cycle_min_lr`` and ``cycle_min_mom`` (the values it sets before its first step)."""

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

    def _sizes(self) -> tuple[float, float]:
        first = float(self.cycle_first_step_size)
        second = float(self.cycle_second_step_size) if self.cycle_second_step_size is not None else first
        if first <= 0 or second < 0:
            raise ValueError("config key 'scheduler.params.cycle_first_step_size': must be > 0 "
                             "(and cycle_second_step_size >= 0)")
        return first, second

    def _scale(self, step: int) -> float | None:
        """Where in the cycle the update after ``step`` steps is, 0 (bottom) … 1 (top);
        None after the cycle (DeepSpeed: batch index ``step - 1`` at or past the cycle)."""
        first, second = self._sizes()
        total = first + second
        if step - 1 >= total:
            return None
        x = 1.0 + step / total - math.floor(1 + step / total)  # position in the cycle, 0 ≤ x < 1
        ratio = first / total
        scale, stairs = (x / ratio, self.cycle_first_stair_count) if x <= ratio else \
            ((x - 1) / (ratio - 1), self.cycle_second_stair_count if self.cycle_second_stair_count is not None
             else self.cycle_first_stair_count)
        if stairs and stairs > 0:  # stairs counted from the whole step, not the float scale
            at = step % total
            pos = at * stairs / first if at <= first else (total - at) * stairs / second
            scale = math.floor(pos) / stairs
        return scale

    def _decay_interval(self, step: int) -> float:
        first, second = self._sizes()
        past = step - (first + second)  # DeepSpeed: batch index - cycle length + 1
        return past / self.decay_step_size if self.decay_step_size > 0 else 0.0

    def lr(self, step: int) -> float:
        """The learning rate of the update after ``step`` optimizer steps."""
        if step <= 0:
            return self.cycle_min_lr
        s = self._scale(step)
        if s is not None:
            return self.cycle_min_lr + (self.cycle_max_lr - self.cycle_min_lr) * s
        return self.cycle_min_lr / (1.0 + self.decay_lr_rate * self._decay_interval(step))

    def momentum(self, step: int) -> float | None:
        """Adam's beta1 of the update after ``step`` steps; None when not cycled."""
        if not self.cycle_momentum:
            return None
        if step <= 0:
            return self.cycle_min_mom
        s = self._scale(step)
        if s is not None:
            return self.cycle_max_mom - (self.cycle_max_mom - self.cycle_min_mom) * s
        return self.cycle_max_mom * (1.0 + self.decay_mom_rate * self._decay_interval(step))


class StepScheduler:
    """Sets every param group's lr to ``lr_at(step, base_lr)`` after each optimizer step
    (``step``: optimizer steps taken; 0 at construction, for the first update).
    ``momentum_at(step)`` (OneCycle) sets Adam's betas to ``(momentum, beta2)`` where the
    optimizer has betas (``beta2`` None keeps each group's own), as DeepSpeed."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr_at: Callable[[int, float], float],
                 momentum_at: Callable[[int], float | None] | None = None, beta2: float | None = None) -> None:
        self.optimizer = optimizer
        self.lr_at = lr_at
        self.momentum_at = momentum_at
        self.beta2 = beta2
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self.last_step = 0
        self._apply()

    def _apply(self) -> None:
        mom = self.momentum_at(self.last_step) if self.momentum_at is not None else None
        for g, base in zip(self.optimizer.param_groups, self.base_lrs):
            g["lr"] = self.lr_at(self.last_step, base)
            if mom is not None and "betas" in g:
                g["betas"] = (mom, self.beta2 if self.beta2 is not None else tuple(g["betas"])[1])

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
        allowed = set(inspect.signature(probe).parameters) - {"step", "base_lr"}
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
        cycle.lr(1)  # sizes checked now, not at the first step
        has_betas = "betas" in optimizer.defaults  # DeepSpeed cycles momentum only through Adam's betas
        return StepScheduler(optimizer, lambda s, base: cycle.lr(s), cycle.momentum if has_betas else None,
                             beta2=ONE_CYCLE_BETA2)
    fns = {
        "WarmupLR": lambda s, base: warmup_lr(s, **params, base_lr=base),
        "WarmupDecayLR": lambda s, base: warmup_decay_lr(s, **params),
        "WarmupCosineLR": lambda s, base: base * warmup_cosine_ratio(s, **params),
        "LRRangeTest": lambda s, base: lr_range_test_lr(s, **params),
    }
    return StepScheduler(optimizer, fns[kind])
