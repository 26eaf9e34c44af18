"""The tensor-parallel token mappings of an MoE layer (DeepSpeed's ``drop_tokens`` /
``gather_tokens``) and the all-to-all byte formula of duplicate-token dropping.

Dropping a slice of a tensor replicated over tp has an all-gather as its backward (the
gradient of a replicated tensor is whole on every rank); gathering has a slice.
See :mod:`zeal.moe.tensor` for where they are used.
"""

from __future__ import annotations

import torch

from zeal.dist.comm import Comm
from zeal.dist.regions import gather_from_tp, slice_for_tp


def drop_tokens(x: torch.Tensor, comm: Comm, rank: int, dim: int = 1) -> torch.Tensor:
    """DeepSpeed's ``drop_tokens``: tp rank ``rank``'s 1/T slice of ``x`` along ``dim``."""
    return slice_for_tp(x, comm, rank, dim)


def gather_tokens(x: torch.Tensor, comm: Comm, rank: int, dim: int = 1) -> torch.Tensor:
    """DeepSpeed's ``gather_tokens``: the tp ranks' slices concatenated along ``dim``."""
    return gather_from_tp(x, comm, rank, dim)


def padded_capacity(c: int, tp_size: int) -> int:
    """The capacity rounded up to a multiple of the tp size (the rows the exchange carries)."""
    return -(-c // tp_size) * tp_size


def a2a_bytes_per_call(num_experts: int, capacity: int, hidden: int, elem_size: int, ep: int, tp: int,
                       drop_duplicates: bool = True) -> int:
    """Bytes one rank sends in one MoE all-to-all: its ``[E, C, d]`` buffer (``[E, C'/T, d]``
    with duplicate-token dropping, C' the capacity padded to a multiple of T), less the
    1/ep addressed to itself."""
    rows = padded_capacity(capacity, tp) // tp if (drop_duplicates and tp > 1) else capacity
    return num_experts * rows * hidden * elem_size // ep * (ep - 1)
