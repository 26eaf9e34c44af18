"""DAPO's data-side fixes to GRPO, as pure functions over a step's rollouts and rewards:
dynamic sampling (groups whose answers all score the same have zero advantage and teach
nothing: drop them and sample more), overlong filtering (an answer cut by the length
limit carries no loss) and the soft overlong punishment (a reward that falls linearly
over the last ``buffer`` tokens before the limit)."""

from __future__ import annotations

import torch


def soft_overlong_penalty(lengths: list[int] | torch.Tensor, max_len: int, buffer: int,
                          penalty: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment per answer length ``L`` (``L_max = max_len``,
    ``L_cache = buffer``): 0 while ``L ≤ L_max − L_cache``, then ``(L_max − L_cache − L) /
    L_cache · penalty`` up to ``L_max``, and ``−penalty`` beyond. ``buffer`` 0: all zeros."""
    lens = torch.as_tensor(lengths, dtype=torch.float32)
    if buffer <= 0:
        return torch.zeros_like(lens)
    if buffer > max_len:
        raise ValueError(f"overlong_buffer {buffer} exceeds max_new_tokens {max_len}")
    start = max_len - buffer
    out = (start - lens) / buffer * penalty
    out = torch.where(lens <= start, torch.zeros_like(out), out)
    return torch.where(lens > max_len, torch.full_like(out, -penalty), out)


def informative_groups(rewards: torch.Tensor, group_size: int, atol: float = 0.0) -> torch.Tensor:
    """Indices of the groups (``group_size`` consecutive rewards) whose rewards are not all
    equal (within ``atol``): the only ones with a non-zero GRPO advantage."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards are not groups of {group_size}")
    g = rewards.float().view(-1, group_size)
    spread = g.max(1).values - g.min(1).values
    return torch.nonzero(spread > atol).flatten()


def fill_groups(kept: list[tuple[int, list, torch.Tensor]], need: int,
                spare: list[tuple[int, list, torch.Tensor]]) -> list[tuple[int, list, torch.Tensor]]:
    """The batch dynamic sampling trains on: the first ``need`` informative groups kept so
    far, topped up with uniform ``spare`` groups (in the order drawn) when the generation
    budget ran out before ``need`` were found. Each group: ``(prompt index, rollouts, rewards)``."""
    out = kept[:need]
    return out + spare[: need - len(out)]


def truncated(finish_reasons: list[str | None]) -> torch.Tensor:
    """1 for an answer that stopped at the length limit (``finish_reason == 'length'``)."""
    return torch.tensor([1.0 if f == "length" else 0.0 for f in finish_reasons])
