"""ZeRO for expert parameters: units over the expert-data group, their own reducer.

An expert lives on one ep rank and is replicated over that rank's expert-data
(``edp``) group, so ZeRO lays expert parameters into flat units of their own sharded
over ``mesh.edp`` (``unit.comm`` names that Comm; ``unit.expert`` is True) while every
other parameter stays in units over ``mesh.dp``: buckets at stages 0–2
(:func:`build_expert_units`), per-module units at stage 3
(:func:`partitioned_expert_split`, given to ``build_module_units``).

* Gradients: the ep all-to-all's backward already summed, on the expert's rank, the
  gradient of every token routed to it from the whole ep group; reducing over ``edp``
  completes the sum over the data-parallel group, so the mean divides by the dp size
  (not the edp size). Stage 3 reduce-scatters them over ``edp``.
* Stage 3 parameters: an expert unit is all-gathered over ``edp`` for its module's
  forward and backward (:class:`ExpertSplitCollectives` routes each unit to its group;
  ZeRO++'s hpZ and qgZ apply to the non-expert units, qwZ to both).
* Gradient norm: stages 1–3 sum squared shard norms over ``dp`` (each expert shard is
  held by exactly one dp rank: dp = ep × edp); stage 0 holds whole local experts, whose
  squared norms are summed over ``ep``.
"""

from __future__ import annotations

import torch
from torch import nn

from zeal.dist.comm import Comm
from zeal.moe.layer import Experts, is_expert_param
from zeal.zero.grad_sync import GradReducer
from zeal.zero.units import FlatUnit, build_bucket_units
from zeal.zero.zeropp import UnitCollectives


def split_expert_groups(groups: list[list[nn.Parameter]]) -> tuple[list[list[nn.Parameter]], list[list[nn.Parameter]]]:
    """Each optimizer group's parameters → (non-expert, expert), group positions kept."""
    dense = [[p for p in g if not is_expert_param(p)] for g in groups]
    experts = [[p for p in g if is_expert_param(p)] for g in groups]
    return dense, experts


def partitioned_expert_split(edp_rank: int, edp_size: int) -> tuple:
    """The ``experts`` argument of :func:`~zeal.zero.units.build_module_units`: expert
    parameters in units of their own, sharded over the expert-data group."""
    return is_expert_param, edp_rank, edp_size


def mark_expert_units(units: list[FlatUnit], edp: Comm) -> None:
    """Stage 3: the expert units (``unit.expert``) are sharded over ``edp``."""
    for u in units:
        if u.expert:
            u.comm = edp


def expert_buffer_ids(model: nn.Module) -> set[int]:
    """Ids of the buffers inside expert containers: replicated over edp only."""
    return {id(b) for m in model.modules() if isinstance(m, Experts) for b in m.buffers()}


class ExpertSplitCollectives:
    """Two :class:`~zeal.zero.zeropp.UnitCollectives` behind one (stage 3): expert units
    gathered over edp, the others over dp (with ZeRO++'s node groups); the same methods
    the coordinator and the non-expert reducer call."""

    def __init__(self, dense: UnitCollectives, experts: UnitCollectives) -> None:
        self.dense, self.experts = dense, experts
        self.home = dense.home

    def _of(self, u: FlatUnit) -> UnitCollectives:
        return self.experts if u.expert else self.dense

    def gather(self, u: FlatUnit, backward: bool):
        return self._of(u).gather(u, backward)

    def refresh(self, u: FlatUnit) -> None:
        self._of(u).refresh(u)

    def drop_secondary(self) -> None:
        self.dense.drop_secondary()
        self.experts.drop_secondary()

    def reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor):
        """The non-expert gradient reduce-scatter (expert units have their own reducer)."""
        return self.dense.reduce_scatter(out, flat)


def build_expert_units(model: nn.Module, groups: list[list[nn.Parameter]], bucket_elems: int, edp: Comm,
                       edp_rank: int, first_index: int, dtype: torch.dtype, device: torch.device) -> list[FlatUnit]:
    """Bucket units of the expert parameters, sharded over ``edp``; indices follow the
    non-expert units'."""
    units = build_bucket_units(model, groups, bucket_elems, edp_rank, edp.size, dtype, device)
    for u in units:
        u.index += first_index
        u.comm, u.expert = edp, True
    return units


class ExpertSplitReducer:
    """Two :class:`GradReducer` behind one: non-expert units over dp, expert units over
    edp (mean over dp). Same methods as a GradReducer, routed by unit; ``ep`` is what the
    optimizer sums stage-0 expert norms over."""

    def __init__(self, dense: GradReducer, experts: GradReducer, ep: Comm) -> None:
        self.dense, self.experts, self.ep = dense, experts, ep  # ep: stage 0 sums expert norms over it
        self.parts = (dense, experts)
        self.units = dense.units + experts.units
        self.mode = dense.mode

    def _of(self, u: FlatUnit) -> GradReducer:
        return self.experts if u.expert else self.dense

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
        return self._of(u).reduced_grad(u)

    def flat_grads(self, units: list[FlatUnit], grads: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([g.reshape(-1) for g in grads])

    def nbytes(self) -> int:
        return sum(r.nbytes() for r in self.parts)

    def buffer_nbytes(self) -> int:
        return sum(r.buffer_nbytes() for r in self.parts)

