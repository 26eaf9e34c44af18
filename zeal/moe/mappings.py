"""The tensor-parallel token mappings of an MoE layer (DeepSpeed's ``drop_tokens`` /
``gather_tokens``) and the all-to-all byte formula of duplicate-token dropping.

Dropping a slice of a tensor replicated over tp has an all-gather as its backward (the
gradient of a replicated tensor is whole on every rank); gathering has a slice.
See :mod:`zeal.moe.tensor` for where they are used.
"""

from __future__ import annotations

import torch

from zeal.dist.comm import Comm

ACTIVATION = "activation"  # the Comm kind of tensor-parallel activation traffic (as zeal.parallel.tensor)


def _gather(x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
    """Every tp rank's ``x`` concatenated along ``dim`` in tp-rank order."""
    x = x.contiguous()
    every = torch.empty(comm.size * x.numel(), dtype=x.dtype, device=x.device)
    comm.all_gather(every, x.view(-1), ACTIVATION)
    return torch.cat(list(every.view(comm.size, *x.shape)), dim=dim)


def _slice(x: torch.Tensor, size: int, rank: int, dim: int) -> torch.Tensor:
    n = x.shape[dim] // size
    return x.narrow(dim, rank * n, n).contiguous()


class _DropTP(torch.autograd.Function):
    """This tp rank's slice of a replicated tensor along ``dim``; backward all-gathers."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, rank: int, dim: int) -> torch.Tensor:  # noqa: D102
        ctx.comm, ctx.dim = comm, dim
        return _slice(x, comm.size, rank, dim)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: D102
        return _gather(g, ctx.comm, ctx.dim), None, None, None


class _GatherTP(torch.autograd.Function):
    """Every tp rank's slice concatenated along ``dim`` (a replicated result); backward
    keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, rank: int, dim: int) -> torch.Tensor:  # noqa: D102
        ctx.comm, ctx.rank, ctx.dim = comm, rank, dim
        return _gather(x, comm, dim)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: D102
        return _slice(g, ctx.comm.size, ctx.rank, ctx.dim), None, None, None


def drop_tokens(x: torch.Tensor, comm: Comm, rank: int, dim: int = 1) -> torch.Tensor:
    """DeepSpeed's ``drop_tokens``: tp rank ``rank``'s 1/T slice of ``x`` along ``dim``."""
    return _DropTP.apply(x, comm, rank, dim) if comm.active else x


def gather_tokens(x: torch.Tensor, comm: Comm, rank: int, dim: int = 1) -> torch.Tensor:
    """DeepSpeed's ``gather_tokens``: the tp ranks' slices concatenated along ``dim``."""
    return _GatherTP.apply(x, comm, rank, dim) if comm.active else x


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
