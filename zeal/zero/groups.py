"""Parameter groups with a Comm of their own: ZeRO's layout for parameters that do not
live on every data-parallel rank.

By default every trainable parameter is laid out, gathered and reduced over ZeRO's
data-parallel Comm. An apply-step that places some parameters on a sub-group of those
ranks (each rank of another group holding *different* parameters of the set) hands
ZeRO a :class:`CommGroup`: the parameters' units are sharded, gathered, broadcast and
reduced over ``comm``; their gradients are averaged over ``mean_over`` ranks (the
ranks whose data contributed to them, when something before ZeRO already summed part
of it); and at stage 0, where a rank's norm needs no reduction, their squared
gradient norms are summed over ``spread``, the ranks holding the set's other members.
ZeRO never asks why: the apply-step that placed the parameters says.

At stages 1–3 the data-parallel sum of squared shard norms already covers every
shard of such a set exactly once when ``comm`` × ``spread`` = the data-parallel group.

A unit's ``comm_group`` is the 1-based index of its group in ``apply_zero``'s list
(0: ZeRO's own Comm); :class:`RoutedCollectives` and :class:`RoutedReducer` put one
per-Comm collective set / reducer behind the one interface the coordinator and the
optimizer call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from zeal.dist.comm import Comm
from zeal.zero.grad_sync import GradReducer
from zeal.zero.units import FlatUnit
from zeal.zero.zeropp import UnitCollectives


@dataclass(frozen=True)
class CommGroup:
    """Parameters (and buffers) ZeRO lays out over ``comm`` instead of its data-parallel
    Comm; see the module docstring for ``mean_over`` and ``spread``."""

    params: frozenset[int]  # ids of the parameters
    comm: Comm
    mean_over: int  # gradients are the mean over this many ranks
    spread: Comm | None = None  # stage 0: the group's squared gradient norms are summed over it
    buffers: frozenset[int] = field(default_factory=frozenset)  # ids of buffers broadcast over ``comm``
    name: str = "group"

    def holds(self, t: torch.Tensor) -> bool:
        return id(t) in self.params


def group_index(groups: list[CommGroup], t: torch.Tensor) -> int:
    """1 + the index of the group holding parameter ``t``, or 0 (ZeRO's own Comm)."""
    for i, g in enumerate(groups):
        if id(t) in g.params:
            return i + 1
    return 0


def split_groups(param_groups: list[list[nn.Parameter]], groups: list[CommGroup]) -> list[list[list[nn.Parameter]]]:
    """Each optimizer group's parameters split by CommGroup: ``[own, group 1, group 2, ...]``,
    each a list of optimizer groups (positions kept)."""
    return [[[p for p in g if group_index(groups, p) == i] for g in param_groups] for i in range(len(groups) + 1)]


def comm_of(groups: list[CommGroup], default: Comm, t: torch.Tensor, buffer: bool = False) -> Comm:
    """The Comm a parameter (or, with ``buffer``, a buffer) is laid out over."""
    for g in groups:
        if id(t) in (g.buffers if buffer else g.params):
            return g.comm
    return default


class RoutedCollectives:
    """Several :class:`~zeal.zero.zeropp.UnitCollectives` behind one (stage 3): each unit is
    gathered over its group's Comm (``parts[unit.comm_group]``; ZeRO++'s node groups apply
    to ZeRO's own); the methods the coordinator and the reducer call."""

    def __init__(self, parts: list[UnitCollectives]) -> None:
        self.parts = parts
        self.home = parts[0].home

    def gather(self, u: FlatUnit, backward: bool):
        return self.parts[u.comm_group].gather(u, backward)

    def refresh(self, u: FlatUnit) -> None:
        self.parts[u.comm_group].refresh(u)

    def drop_secondary(self) -> None:
        for c in self.parts:
            c.drop_secondary()

    def reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor):
        """The reduce-scatter of ZeRO's own units (the other groups have reducers of their own)."""
        return self.parts[0].reduce_scatter(out, flat)


class RoutedReducer:
    """Several :class:`GradReducer` behind one, routed by ``unit.comm_group``: ZeRO's own
    units over the data-parallel Comm, each group's over its Comm. ``spread``:
    ``(comm_group, Comm)`` pairs whose stage-0 squared norms the optimizer sums over the Comm."""

    def __init__(self, parts: list[GradReducer], spread: list[tuple[int, Comm]]) -> None:
        self.parts = parts
        self.spread = spread
        self.units = [u for r in parts for u in r.units]
        self.mode = parts[0].mode

    def begin_backward(self, boundary: bool) -> None:
        for r in self.parts:
            r.begin_backward(boundary)

    def finish_backward(self) -> None:
        for r in self.parts:
            r.finish_backward()

    def wait_all(self) -> None:
        for r in self.parts:
            r.wait_all()

    def zero(self) -> None:
        for r in self.parts:
            r.zero()

    def reduced_grad(self, u: FlatUnit) -> torch.Tensor:
        return self.parts[u.comm_group].reduced_grad(u)

    def flat_grads(self, units: list[FlatUnit], grads: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([g.reshape(-1) for g in grads])

    def nbytes(self) -> int:
        return sum(r.nbytes() for r in self.parts)

    def buffer_nbytes(self) -> int:
        return sum(r.buffer_nbytes() for r in self.parts)
