"""A batch's sequence chunks and the whole sequences' loss over them: what the plain
sequence-parallel path (:mod:`zeal.parallel.sequence`) and the pipelined one
(:mod:`zeal.parallel.sequence_pipe`) share, below both.

:func:`shard_batch` cuts full sequences into this rank's chunk (labels shifted before the
cut, the length padded to a multiple of S); :func:`sequence_loss` turns a chunk's loss sum
and token count into the full sequences' mean on every sp rank (one "control"
all-reduce over sp; backward hands each token S / count, see :mod:`zeal.parallel.sequence`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from zeal.dist.comm import Comm

IGNORE = -100


def shard_batch(ids: torch.Tensor, labels: torch.Tensor | None, pos: torch.Tensor | None,
                comm: Comm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """This rank's chunk of full sequences ``ids`` (B, T): (ids, global positions, shifted
    labels or None, T). Labels are shifted before sharding; T is padded to a multiple of
    S (pad labels -100, pad positions repeat the last one)."""
    s, r = comm.size, comm.ranks.index(comm.ctx.rank)
    b, t = ids.shape
    if pos is None:
        pos = torch.arange(t, device=ids.device)
    pos = pos.expand(b, t)
    y = None
    if labels is not None:
        labels = labels.reshape(b, t)
        y = F.pad(labels[:, 1:], (0, 1), value=IGNORE)  # shift BEFORE sharding
    pad = -t % s
    if pad:
        ids = F.pad(ids, (0, pad), value=0)
        pos = torch.cat([pos, pos[:, -1:].expand(b, pad)], dim=1)
        y = None if y is None else F.pad(y, (0, pad), value=IGNORE)
    n = (t + pad) // s
    cut = slice(r * n, (r + 1) * n)
    return ids[:, cut], pos[:, cut], None if y is None else y[:, cut], t


def sequence_loss(total: torch.Tensor, count: torch.Tensor, comm: Comm) -> torch.Tensor:
    """The whole sequences' mean from this chunk's loss sum and token count (see the module
    docstring: the value on every sp rank, S / count per token in backward)."""
    return _SequenceLoss.apply(total, count.to(torch.float64), comm)


class _SequenceLoss(torch.autograd.Function):
    """sum over sp of the chunks' loss sums / their token count; backward: S / count."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, count: torch.Tensor, comm: Comm) -> torch.Tensor:
        both = torch.stack([local.detach().to(torch.float64), count])
        comm.all_reduce(both, "control")
        total = both[1].clamp(min=1)
        ctx.scale = comm.size / float(total)
        return (both[0] / total).to(local.dtype)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return g * ctx.scale, None, None
