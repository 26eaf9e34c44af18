"""``deepspeed.runtime.lr_schedules``: DeepSpeed's schedulers as classes a script builds
itself (``WarmupLR(optimizer, ...)``) and passes to ``initialize(lr_scheduler=...)``.

Each is zeal's schedule (:mod:`zeal.train.lr_schedules`, the same functions the
config's ``scheduler`` section uses) over the optimizer: ``step()`` after each optimizer
step, ``get_lr()``, ``get_last_lr()``, ``state_dict()``."""

from __future__ import annotations

from typing import Any

import torch

from zeal.train.lr_schedules import StepScheduler, build_scheduler

WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR, ONE_CYCLE, LR_RANGE_TEST = (
    "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]
WARMUP_LOG_RATE, WARMUP_LINEAR_RATE = "log", "linear"


class _Schedule(StepScheduler):
    kind = ""

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int = -1, **params: Any) -> None:
        self.params = {k: v for k, v in params.items() if v is not None}
        built = build_scheduler(self.kind, self.params, optimizer)
        super().__init__(optimizer, built.lr_at, built.momentum_at)
        if last_batch_iteration >= 0:
            self.last_step = last_batch_iteration + 1
            self._apply()

    def get_lr(self) -> list[float]:
        return self.get_last_lr()

    @property
    def last_batch_iteration(self) -> int:
        return self.last_step - 1


class WarmupLR(_Schedule):
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``, then hold."""

    kind = WARMUP_LR

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr: float = 0.0, warmup_max_lr: float = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = WARMUP_LOG_RATE,
                 last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration, warmup_min_lr=warmup_min_lr, warmup_max_lr=warmup_max_lr,
                         warmup_num_steps=warmup_num_steps, warmup_type=warmup_type)


class WarmupDecayLR(_Schedule):
    """:class:`WarmupLR`, then linear decay back to ``warmup_min_lr`` at ``total_num_steps``."""

    kind = WARMUP_DECAY_LR

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_lr: float = 0.0,
                 warmup_max_lr: float = 0.001, warmup_num_steps: int = 1000, warmup_type: str = WARMUP_LOG_RATE,
                 last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration, total_num_steps=total_num_steps,
                         warmup_min_lr=warmup_min_lr, warmup_max_lr=warmup_max_lr,
                         warmup_num_steps=warmup_num_steps, warmup_type=warmup_type)


class WarmupCosineLR(_Schedule):
    """Warm up to the optimizer's lr, then cosine decay to ``cos_min_ratio`` of it."""

    kind = WARMUP_COSINE_LR

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = WARMUP_LOG_RATE,
                 last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration, total_num_steps=total_num_steps,
                         warmup_min_ratio=warmup_min_ratio, warmup_num_steps=warmup_num_steps,
                         cos_min_ratio=cos_min_ratio, warmup_type=warmup_type)


class LRRangeTest(_Schedule):
    """Grow the lr from ``lr_range_test_min_lr`` by ``lr_range_test_step_rate`` every
    ``lr_range_test_step_size`` steps (continuous or staircase)."""

    kind = LR_RANGE_TEST

    def __init__(self, optimizer: torch.optim.Optimizer, lr_range_test_min_lr: float = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration, lr_range_test_min_lr=lr_range_test_min_lr,
                         lr_range_test_step_size=lr_range_test_step_size,
                         lr_range_test_step_rate=lr_range_test_step_rate,
                         lr_range_test_staircase=lr_range_test_staircase)


class OneCycle(_Schedule):
    """The 1-cycle policy (lr and momentum), DeepSpeed's parameters."""

    kind = ONE_CYCLE

    def __init__(self, optimizer: torch.optim.Optimizer, cycle_min_lr: float, cycle_max_lr: float,
                 last_batch_iteration: int = -1, **params: Any) -> None:
        super().__init__(optimizer, last_batch_iteration, cycle_min_lr=cycle_min_lr, cycle_max_lr=cycle_max_lr,
                         **params)
