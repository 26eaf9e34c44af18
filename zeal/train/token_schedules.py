"""Learning-rate schedules driven by consumed tokens rather than steps.

Curriculum learning and random-LTD change the tokens (or layer-tokens) a step costs, so
warm-up and decay follow what was consumed (Megatron-DeepSpeed's ``--lr-warmup-tokens``,
``--lr-decay-tokens``, ``--train-tokens``; the LayerToken schedule of the random-LTD paper):

* warm-up: ``lr = max_lr · n / warmup`` while ``n <= warmup`` (``n`` consumed tokens);
* decay: ``ratio = (n − warmup) / (decay − warmup)``, ``lr = min_lr + c · (max_lr − min_lr)``
  with ``c = 1 − ratio`` (linear), ``(cos(π·ratio) + 1) / 2`` (cosine) or 1 (constant);
  ``min_lr`` once ``n > decay``.

:class:`TokenLRScheduler` applies it after each optimizer step, reading the count from
a :class:`TokenCounter` that the training loop advances (``engine.lr_scheduler`` can be one).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from zeal.train.lr_schedules import StepScheduler


def token_lr(tokens: int, max_lr: float, min_lr: float = 0.0, warmup_tokens: int = 0,
             decay_tokens: int | None = None, style: str = "cosine") -> float:
    """The learning rate after ``tokens`` consumed tokens (module docstring)."""
    if warmup_tokens > 0 and tokens <= warmup_tokens:
        return max_lr * tokens / warmup_tokens
    if style == "constant" or decay_tokens is None:
        return max_lr
    if tokens > decay_tokens:
        return min_lr
    span = decay_tokens - warmup_tokens
    ratio = (tokens - warmup_tokens) / span if span > 0 else 1.0
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:
        raise ValueError(f"lr decay style {style!r} is not linear, cosine or constant")
    return min_lr + coeff * (max_lr - min_lr)


def layer_token_lr(layer_tokens: int, max_lr: float, total_layer_tokens: int, warmup_layer_tokens: int = 0,
                   warmup_type: str = "linear", min_lr: float = 0.0) -> float:
    """The LayerToken schedule: warm-up over ``warmup_layer_tokens`` (``linear``, or ``log``:
    ``max_lr · log(1 + n) / log(1 + warmup)``), then cosine decay to ``min_lr`` at
    ``total_layer_tokens``, all counted in consumed layer-tokens."""
    if warmup_layer_tokens > 0 and layer_tokens <= warmup_layer_tokens and warmup_type == "log":
        return max_lr * math.log1p(layer_tokens) / math.log1p(warmup_layer_tokens)
    return token_lr(layer_tokens, max_lr, min_lr, warmup_layer_tokens, total_layer_tokens, "cosine")


@dataclass
class TokenCounter:
    """Tokens and layer-tokens consumed so far (over all data-parallel ranks)."""

    tokens: int = 0
    layer_tokens: int = 0

    def add(self, tokens: int, layer_tokens: int | None = None) -> None:
        self.tokens += int(tokens)
        self.layer_tokens += int(tokens if layer_tokens is None else layer_tokens)


class TokenLRScheduler(StepScheduler):
    """Sets each param group's lr to ``lr_of(count()) · base / base[0]`` after every step
    (and at construction); ``count`` reads the consumed tokens (or layer-tokens). Steps,
    ``get_last_lr`` and the state dict are :class:`StepScheduler`'s."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr_of: Callable[[int], float],
                 count: Callable[[], int]) -> None:
        self.lr_of, self.count = lr_of, count
        super().__init__(optimizer, lambda step, base: base)

    def _apply(self) -> None:
        lr = self.lr_of(self.count())
        ref = float(self.base_lrs[0]) or 1.0
        for g, base in zip(self.optimizer.param_groups, self.base_lrs):
            g["lr"] = lr * (float(base) / ref)

    def refresh(self) -> None:
        """Re-read the count (after a resumed job restored it)."""
        self._apply()
