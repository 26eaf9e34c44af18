"""A ZeRO stage, resolved once from the config into one strategy object.

The stage decides three things, and nothing else in zeal tests the stage number:

* how gradients are reduced (the :class:`~zeal.zero.grad_sync.GradReducer` mode);
* which slice of each flat unit this rank owns for the optimizer (the whole unit at
  stage 0, its shard ``[start, start + shard_numel)`` at stages 1–3) and where the
  master's initial values are read;
* how updated masters go back to the model: a copy (stage 0), a copy into the shard
  then an all-gather of the unit (stages 1–2), or into the shard's home (stage 3,
  where parameters stay partitioned; the home may be memory or NVMe).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zeal.dist.comm import Comm
from zeal.zero.offload.staging import Staging
from zeal.zero.shard_home import DiskShards, MemoryShards
from zeal.zero.units import FlatUnit


def gather_replicated(comm: Comm, units: list[FlatUnit]) -> None:
    """Stages 1–2: after each rank updated its shard (a view of ``full``), rebuild every
    unit's full buffer."""
    works = [(u.comm or comm).all_gather(u.full, u.shard, "param", async_op=True) for u in units]
    for w in works:
        w.wait()


@dataclass(frozen=True)
class ZeroStage:
    """What one stage partitions. Use :func:`resolve_stage`; instances are immutable."""

    number: int
    grad_mode: str               # GradReducer mode
    partitions_optimizer: bool   # stages 1-3: masters and moments of this rank's shard only
    partitions_params: bool      # stage 3: the full parameters exist only while gathered

    def owned_start(self, u: FlatUnit) -> int:
        """Offset in ``u``'s flat buffer of the first element this rank's master holds."""
        return u.start if self.partitions_optimizer else 0

    def model_slice(self, u: FlatUnit, home: MemoryShards | DiskShards) -> torch.Tensor:
        """The model values this rank's master covers (call ``home.done(u)`` after, for a
        partitioned unit: a disk home lends a buffer)."""
        return home.get(u) if self.partitions_optimizer else u.full

    @torch.no_grad()
    def write_back(self, units: list[FlatUnit], masters: list[torch.Tensor], comm: Comm,
                   home: MemoryShards | DiskShards, staging: Staging | None = None,
                   hosted: list[bool] | None = None) -> None:
        """Put updated masters into the model so every rank sees the new values
        (``staging``: the masters are host tensors across that boundary; ``hosted``: only
        those units' are, under partial offload)."""
        for i, (u, m) in enumerate(zip(units, masters)):
            crossing = staging if hosted is None or hosted[i] else None
            if self.partitions_params:
                if crossing is not None:
                    home.put_host(u, m, crossing)
                else:
                    home.put(u, m)
                continue
            dst = u.shard if self.partitions_optimizer else u.full
            if crossing is not None:
                crossing.upload(dst, m, key=("up", u.index))
            elif m.data_ptr() != dst.data_ptr():  # fp32 masters may be the parameter storage
                dst.copy_(m)
        if self.partitions_optimizer and not self.partitions_params:
            gather_replicated(comm, units)

    def norm_needs_reduce(self) -> bool:
        """Whether the squared gradient norm must be summed over ranks (each rank holds a
        slice of the mean gradient), or is already whole (stage 0)."""
        return self.partitions_optimizer


STAGES = {
    0: ZeroStage(0, "all_reduce", partitions_optimizer=False, partitions_params=False),
    1: ZeroStage(1, "scatter_at_boundary", partitions_optimizer=True, partitions_params=False),
    2: ZeroStage(2, "scatter_every_step", partitions_optimizer=True, partitions_params=False),
    3: ZeroStage(3, "scatter_every_step", partitions_optimizer=True, partitions_params=True),
}


def resolve_stage(stage: int | ZeroStage) -> ZeroStage:
    """The strategy of ``zero_optimization.stage`` (0–3)."""
    if isinstance(stage, ZeroStage):
        return stage
    try:
        return STAGES[stage]
    except KeyError:
        raise ValueError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage}") from None
