"""Sparsified parameters seen on the ZeRO shards: N:M groups over flat fp32 masters.

ZeRO gives every rank a flat master (fp32) covering a range of each flat unit: the whole
unit at stage 0, its shard at stages 1–3. A sparsified parameter appears in a master as
a *segment*: a flat range of the master holding a flat range of the parameter. Masks,
ADMM's Z and U are flat tensors of the master's shape, so they live on the shards and
are updated by plain elementwise operations.

N:M groups lie along the input dimension, i.e. they are runs of ``m`` consecutive flat
elements of an ``nn.Linear`` weight (``[out, in]``, ``in % m == 0``). A unit is handled
*locally* when, for every rank, every segment of it starts and ends on a group boundary
(then each rank projects its own groups, no communication). Otherwise a partition
boundary cuts a group, or the groups are not contiguous (``dim=0``, a GPT-2 ``Conv1D``),
or the mask is not N:M (row pruning): the unit's masters are all-gathered once (fp32,
accounted as "param" traffic on the dp Comm), the projection or mask is computed on the
full parameter, identically on every rank, and each rank keeps its slice. This happens
only when masks are made and at ADMM's Z-steps (every ``admm_interval`` optimizer steps).
The decision is a pure function of the layout, so all ranks take the same path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from zeal.dist.comm import Comm
from zeal.zero.partition import shard_range, slot_overlap

__all__ = ["Segment", "ShardedParams", "TargetSpec"]

# fn(values of the whole parameter or of whole groups, dim, name) -> same shape
GroupFn = Callable[[torch.Tensor, int, str], torch.Tensor]


@dataclass(frozen=True)
class TargetSpec:
    """How one parameter is compressed: ``n`` of every ``m`` along ``dim`` (``n == m``:
    no N:M constraint, for masks made by another rule)."""

    n: int
    m: int
    dim: int = -1


@dataclass(frozen=True)
class Segment:
    """Flat elements ``[lo, hi)`` of a master holding flat elements ``[start, start + hi - lo)``
    of parameter ``name`` (of global ``shape``)."""

    name: str
    lo: int
    hi: int
    start: int
    shape: tuple[int, ...]
    spec: TargetSpec


@dataclass
class _Entry:
    unit: object  # FlatUnit
    param: torch.Tensor  # the optimizer's master Parameter (its state is keyed by it)
    master: torch.Tensor  # flat fp32 view of it
    segments: list[Segment]
    local: bool  # every rank's segments hold whole contiguous groups


class ShardedParams:
    """The sparsified parameters of a ZeRO optimizer's masters (``units``/``masters`` as
    :class:`~zeal.zero.optimizer.ZeroOptimizer` holds them; ``owned_start(unit)`` is the
    flat offset its master starts at). Keys are ``str(i)`` per master with a segment."""

    def __init__(self, units: list, masters: list[torch.Tensor], owned_start: Callable[[object], int],
                 partitioned: bool, comm: Comm, targets: dict[str, TargetSpec]) -> None:
        self.comm, self.partitioned = comm, partitioned
        self.entries: dict[str, _Entry] = {}
        for i, (u, m) in enumerate(zip(units, masters)):
            base = owned_start(u)
            if any(slot.name in targets for slot in u.slots):  # on some rank: a collective key
                segs = _segments(u, base, base + m.numel(), targets)
                local = all(_whole_groups(u, r, comm.size, partitioned, targets) for r in range(comm.size))
                self.entries[str(i)] = _Entry(u, m, m.data.view(-1), segs, local)
        self.names = sorted({s.name for e in self.entries.values() for s in e.segments})

    def masters(self) -> dict[str, torch.Tensor]:
        """The master Parameters by key (flat; their ``.grad`` is what the optimizer reads)."""
        return {k: e.param for k, e in self.entries.items()}

    def region(self) -> dict[str, torch.Tensor]:
        """Per key, 1.0 on the sparsified elements of the master, 0.0 elsewhere."""
        out = {}
        for k, e in self.entries.items():
            r = torch.zeros_like(e.master)
            for s in e.segments:
                r[s.lo:s.hi] = 1.0
            out[k] = r
        return out

    def apply(self, key: str, values: torch.Tensor, fn: GroupFn) -> torch.Tensor:
        """``values`` (flat, the master's shape) with ``fn`` applied to every segment's
        parameter values, outside segments unchanged. All ranks call it together, for
        every key (a rank may hold no segment of a unit that another rank must gather)."""
        e = self.entries[key]
        out = values.clone()
        if e.local:
            for s in e.segments:
                g = values[s.lo:s.hi].view(-1, s.spec.m)  # whole groups along the last dim
                out[s.lo:s.hi] = fn(g, -1, s.name).reshape(-1).to(out.dtype)
            return out
        full = self._gather(e, values)
        slots = {slot.name: slot for slot in e.unit.slots}
        for s in e.segments:
            slot = slots[s.name]
            res = fn(full[slot.offset:slot.end].view(tuple(slot.shape)), s.spec.dim, s.name).reshape(-1)
            out[s.lo:s.hi] = res[s.start:s.start + s.hi - s.lo].to(out.dtype)
        return out

    def _gather(self, e: _Entry, values: torch.Tensor) -> torch.Tensor:
        """The unit's whole flat buffer of ``values`` (fp32)."""
        if not self.partitioned:
            return values
        full = torch.empty(e.unit.padded, dtype=values.dtype, device=values.device)
        self.comm.all_gather(full, values, "param")
        return full

    def sum_over_ranks(self, x: float) -> float:
        """Residual sums: each rank owns its elements once (stages 1–3); at stage 0 every
        rank holds the same whole masters, so nothing is added."""
        return self.comm.all_reduce_scalar(x) if self.partitioned else x


def _segments(u, lo: int, hi: int, targets: dict[str, TargetSpec]) -> list[Segment]:
    out = []
    for slot in u.slots:
        spec = targets.get(slot.name)
        ov = slot_overlap(slot, lo, hi) if spec is not None else None
        if ov is None:
            continue
        a, b = ov
        out.append(Segment(slot.name, slot.offset + a - lo, slot.offset + b - lo, a, tuple(slot.shape), spec))
    return out


def _whole_groups(u, rank: int, world: int, partitioned: bool, targets: dict[str, TargetSpec]) -> bool:
    """Whether rank ``rank``'s part of every target in ``u`` is made of whole contiguous groups."""
    lo, hi = shard_range(u.padded, rank, world) if partitioned else (0, u.padded)
    for slot in u.slots:
        spec = targets.get(slot.name)
        if spec is None:
            continue
        if spec.dim not in (-1, len(slot.shape) - 1) or spec.n == spec.m:
            return False
        ov = slot_overlap(slot, lo, hi)
        if ov is not None and (ov[0] % spec.m or ov[1] % spec.m):
            return False
    return True
