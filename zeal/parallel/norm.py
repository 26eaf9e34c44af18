"""The global gradient norm under tensor parallelism.

Each rank's masters hold a slice (over dp) of its tp rank's parameters. A parameter split
over tp contributes a different part of the global gradient on every tp rank, so its
squares are summed over the tp group; a replicated one (norms, embeddings, the head, row
biases) has the same gradient on every tp rank and is counted once. The dp sum that the
ZeRO stage already does comes after: ``sq = Σ_dp (Σ_tp split² + replicated²)``.
"""

from __future__ import annotations

import torch

from zeal.parallel.tensor import TensorParallel
from zeal.zero.optimizer import squared_norms
from zeal.zero.partition import slot_overlap
from zeal.zero.stages import ZeroStage
from zeal.zero.units import FlatUnit


class TPGradNorm:
    """Squared gradient norm of this rank's masters, with split parameters summed over tp
    (one scalar all-reduce, control traffic). ``units``: the optimizer's trainable units,
    in the order of the gradients given to :meth:`sq`."""

    def __init__(self, tp: TensorParallel, units: list[FlatUnit], stage: ZeroStage) -> None:
        self.comm = tp.comm
        self.segments: list[list[tuple[int, int, bool]]] = []
        for u in units:
            base = stage.owned_start(u)
            end = base + (u.shard_numel if stage.partitions_optimizer else u.padded)
            segs = []
            for slot in u.slots:
                ov = slot_overlap(slot, base, end)
                if ov is not None:
                    lo = slot.offset + ov[0] - base
                    segs.append((lo, lo + ov[1] - ov[0], slot.name in tp.splits))
            self.segments.append(segs)

    def sq(self, grads: list[torch.Tensor]) -> float:
        """Σ_tp (split parameters' squares) + replicated parameters' squares, of these grads."""
        split = repl = 0.0
        pieces = [(g.view(-1)[lo:hi], is_split) for g, segs in zip(grads, self.segments) for lo, hi, is_split in segs]
        for v, (_, is_split) in zip(squared_norms([p for p, _ in pieces]), pieces):  # one host sync
            if is_split:
                split += v
            else:
                repl += v
        return self.comm.all_reduce_scalar(split, "sum") + repl

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` (an overflow) is true on any tp rank."""
        return self.comm.all_reduce_scalar(1.0 if flag else 0.0, "max") > 0
