"""The autograd regions of tensor parallelism (Megatron's ``copy_to`` / ``reduce_from`` /
``scatter_to`` / ``gather_from``): collectives over a tp :class:`~zeal.dist.comm.Comm` whose
backward is the matching collective of the gradient. They know nothing of models or of how
a model is split: :mod:`zeal.parallel.tensor` (the apply-step) and the MoE layer's
duplicate-token dropping (:mod:`zeal.moe.mappings`) both use them. At tp size 1 (an
inactive Comm) each returns its input.
"""

from __future__ import annotations

import torch

from zeal.dist.comm import Comm

__all__ = ["ACTIVATION", "copy_to_tp", "gather_from_tp", "reduce_from_tp", "slice_for_tp"]

ACTIVATION = "activation"  # the Comm kind of tensor-parallel activation traffic


# -- the two collectives of a split pair ----------------------------------------------------
class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the input gradient over tp in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, kind: str) -> torch.Tensor:  # noqa: D102
        ctx.comm, ctx.kind = comm, kind
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: D102
        g = g.contiguous().clone()
        ctx.comm.all_reduce(g, ctx.kind)
        return g, None, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce over tp forward (partial sums of a row-parallel product); identity backward."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, comm: Comm, kind: str) -> torch.Tensor:  # noqa: D102
        y = y.contiguous()
        comm.all_reduce(y, kind)
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: D102
        return g, None, None


def copy_to_tp(x: torch.Tensor, comm: Comm, kind: str = ACTIVATION) -> torch.Tensor:
    """``x`` unchanged; in backward its gradient is summed over the tp group (Comm kind ``kind``)."""
    return _CopyToTP.apply(x, comm, kind) if comm.active else x


def reduce_from_tp(y: torch.Tensor, comm: Comm, kind: str = ACTIVATION) -> torch.Tensor:
    """``y`` summed over the tp group (Comm kind ``kind``; gradient passes through unchanged)."""
    return _ReduceFromTP.apply(y, comm, kind) if comm.active else y


def _gather_along(x: torch.Tensor, comm: Comm, dim: int, kind: str) -> torch.Tensor:
    """Every tp rank's ``x`` concatenated along ``dim`` in tp-rank order."""
    x = x.contiguous()
    every = torch.empty(comm.size * x.numel(), dtype=x.dtype, device=x.device)
    comm.all_gather(every, x.view(-1), kind)
    return torch.cat(list(every.view(comm.size, *x.shape)), dim=dim)


def _slice_along(x: torch.Tensor, size: int, rank: int, dim: int) -> torch.Tensor:
    n = x.shape[dim] // size
    return x.narrow(dim, rank * n, n).contiguous()


class _SliceTP(torch.autograd.Function):
    """This tp rank's slice of a replicated tensor along ``dim``; backward all-gathers."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, rank: int, dim: int, kind: str) -> torch.Tensor:  # noqa: D102
        ctx.comm, ctx.dim, ctx.kind = comm, dim, kind
        return _slice_along(x, comm.size, rank, dim)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: D102
        return _gather_along(g, ctx.comm, ctx.dim, ctx.kind), None, None, None, None


class _GatherTP(torch.autograd.Function):
    """Every tp rank's slice concatenated along ``dim`` (a replicated result); backward
    keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, rank: int, dim: int, kind: str) -> torch.Tensor:  # noqa: D102
        ctx.comm, ctx.rank, ctx.dim = comm, rank, dim
        return _gather_along(x, comm, dim, kind)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: D102
        return _slice_along(g, ctx.comm.size, ctx.rank, ctx.dim), None, None, None, None


def slice_for_tp(x: torch.Tensor, comm: Comm, rank: int, dim: int, kind: str = ACTIVATION) -> torch.Tensor:
    """Tp rank ``rank``'s 1/T slice of the replicated ``x`` along ``dim`` (backward: all-gather)."""
    return _SliceTP.apply(x, comm, rank, dim, kind) if comm.active else x


def gather_from_tp(x: torch.Tensor, comm: Comm, rank: int, dim: int, kind: str = ACTIVATION) -> torch.Tensor:
    """The tp ranks' ``x`` concatenated along ``dim`` (backward: this rank's slice)."""
    return _GatherTP.apply(x, comm, rank, dim, kind) if comm.active else x
