"""Curriculum learning: pacing functions (global step → difficulty) and the difficulty
metrics that need no index (sequence length, applied to a batch) or a token count (``voc``).

Pacing functions are DeepSpeed's, to the rounding (``D_min``, ``D_max``, ``T`` =
``total_curriculum_step``, ``s`` = ``difficulty_step``, ``r`` = ``root_degree``):

* ``fixed_root``: ``f = floor((t / T)^(1/r) · (D_max − D_min) + D_min)``;
  ``d = min(D_max, f − f mod s)`` (rounding applies to the absolute value, so ``d`` may be
  below ``D_min`` when ``D_min`` is not a multiple of ``s``);
* ``fixed_linear``: the same with ``r = 1``;
* ``fixed_discrete``: ``difficulty[i]`` for the first ``i`` with ``t <= max_step[i]``, else
  ``difficulty[-1]``;
* ``custom``: a function of the global step (:meth:`Pacing.set_custom`).

:class:`Pacing` holds the current difficulty (``D_min`` at first) and recomputes it only
while it is below ``D_max``, as DeepSpeed's scheduler does.

Sequence length in zeal counts the tokens of a row as the model gets it (labels are
shifted inside the model): difficulty ``d`` keeps ``d`` tokens, and ``d = seq_len`` is the
batch unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch


def pacing_difficulty(step: int, schedule_type: str, min_difficulty: int, max_difficulty: int,
                      schedule_config: dict[str, Any]) -> int:
    """The difficulty of a fixed pacing function at global step ``step`` (module docstring)."""
    sc = schedule_config
    if schedule_type == "fixed_discrete":
        diff, max_step = sc["difficulty"], sc["max_step"]
        for d, m in zip(diff, max_step):
            if step <= m:
                return int(d)
        return int(diff[-1])
    if schedule_type not in ("fixed_linear", "fixed_root"):
        raise ValueError(f"schedule_type {schedule_type!r} has no fixed formula (custom needs set_custom)")
    root = sc.get("root_degree", 1) if schedule_type == "fixed_root" else 1
    frac = (float(step) / sc["total_curriculum_step"]) ** (1.0 / root)
    f = math.floor(frac * (max_difficulty - min_difficulty) + min_difficulty)
    f -= f % sc["difficulty_step"]
    return int(min(f, max_difficulty))


class Pacing:
    """A pacing function with DeepSpeed's state: ``current`` starts at ``min_difficulty``
    and :meth:`update` recomputes it only while it is below ``max_difficulty``."""

    def __init__(self, schedule_type: str, min_difficulty: int, max_difficulty: int,
                 schedule_config: dict[str, Any] | None = None) -> None:
        self.schedule_type, self.schedule_config = schedule_type, dict(schedule_config or {})
        self.min_difficulty, self.max_difficulty = int(min_difficulty), int(max_difficulty)
        self.current = self.min_difficulty
        self._custom: Callable[[int], int] | None = None

    @classmethod
    def from_config(cls, section: Any) -> Pacing:
        """From a config section with ``schedule_type``, ``min/max_difficulty``, ``schedule_config``."""
        return cls(section.schedule_type, section.min_difficulty, section.max_difficulty, section.schedule_config)

    def set_custom(self, fn: Callable[[int], int]) -> None:
        """The ``custom`` schedule: ``fn(global_step) -> difficulty``."""
        self._custom = fn

    def difficulty(self, step: int) -> int:
        """The function's value at ``step`` (no state change)."""
        if self.schedule_type == "custom":
            if self._custom is None:
                raise ValueError("schedule_type 'custom' needs a function: call set_custom(fn) first")
            return int(self._custom(step))
        return pacing_difficulty(step, self.schedule_type, self.min_difficulty, self.max_difficulty,
                                 self.schedule_config)

    def update(self, step: int) -> int:
        """Advance to ``step``: the current difficulty (unchanged once at ``max_difficulty``)."""
        if self.current < self.max_difficulty:
            self.current = self.difficulty(step)
        return self.current

    def state_dict(self) -> dict[str, int]:
        return {"current": self.current}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.current = int(sd["current"])


# --------------------------------------------------------------------- sequence-length metrics


def seqlen_truncate(input_ids: torch.Tensor, difficulty: int) -> torch.Tensor:
    """``seqlen_truncate``: the first ``difficulty`` tokens of every row of ``(B, T)``."""
    if difficulty >= input_ids.size(-1):
        return input_ids
    if difficulty < 2:
        raise ValueError(f"curriculum sequence length {difficulty} is below 2 tokens")
    return input_ids[..., :difficulty]


def seqlen_reshape(input_ids: torch.Tensor, difficulty: int) -> torch.Tensor:
    """``seqlen_reshape``: the batch re-cut into rows of ``difficulty`` tokens. Each row's
    first ``⌊T/d⌋·d`` tokens become rows of ``d``, then each row's last ``d`` tokens are
    appended; of those, ``min(ceil(B·T/d), rows)`` rows are kept, one fewer when that is odd
    and above 1. The tokens seen are the result's ``numel()``."""
    b, t = input_ids.shape
    d = int(difficulty)
    if d >= t:
        return input_ids
    if d < 2:
        raise ValueError(f"curriculum sequence length {d} is below 2 tokens")
    whole = (t // d) * d
    rows = torch.cat([input_ids[:, :whole].reshape(-1, d), input_ids[:, -d:]], dim=0)
    keep = min(math.ceil(b * t / d), rows.size(0))
    if keep > 1 and keep % 2:
        keep -= 1
    return rows[:keep].contiguous()


def apply_seqlen(input_ids: torch.Tensor, difficulty: int, kind: str) -> torch.Tensor:
    """``kind`` ``"truncate"`` or ``"reshape"`` at ``difficulty`` (see above)."""
    if kind == "truncate":
        return seqlen_truncate(input_ids, difficulty)
    if kind == "reshape":
        return seqlen_reshape(input_ids, difficulty)
    raise ValueError(f"unknown sequence-length metric {kind!r} (truncate or reshape)")


# --------------------------------------------------------------------- vocabulary rarity


def token_counts(samples: Iterable[np.ndarray], vocab_size: int) -> np.ndarray:
    """How often each token id occurs over ``samples`` (int64, length ``vocab_size``)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for s in samples:
        counts += np.bincount(np.asarray(s, dtype=np.int64), minlength=vocab_size)[:vocab_size]
    return counts


def voc_metric(samples: Iterable[np.ndarray], counts: np.ndarray, pad_id: int | None = None) -> np.ndarray:
    """Vocabulary rarity of each sample: ``Σ_w −log(freq(w) / Σ freq)`` over its non-pad
    tokens, zero counts taken as 1, truncated to int64 (Megatron-DeepSpeed's definition)."""
    c = np.where(counts == 0, 1, counts).astype(np.float64)
    neg_log = -np.log(c / c.sum())
    out = []
    for s in samples:
        ids = np.asarray(s, dtype=np.int64)
        if pad_id is not None:
            ids = ids[ids != pad_id]
        out.append(neg_log[ids].sum())
    return np.asarray(out, dtype=np.float64).astype(np.int64)


def seqlen_metric(samples: Iterable[np.ndarray], pad_id: int | None = None) -> np.ndarray:
    """Sequence length of each sample (non-pad tokens), int64."""
    return np.asarray([int(np.sum(np.asarray(s) != pad_id)) if pad_id is not None else len(s) for s in samples],
                      dtype=np.int64)
