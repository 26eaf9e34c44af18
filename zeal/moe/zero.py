"""ZeRO for expert parameters: units over the expert-data group, their own reducer.

An expert lives on one ep rank and is replicated over that rank's expert-data
(``edp``) group, so ZeRO stages 0–2 lay expert parameters into a second set of flat
units sharded over ``mesh.edp`` (``unit.comm`` names that Comm; ``unit.expert`` is
True) while every other parameter stays in units over ``mesh.dp``.

* Gradients: the ep all-to-all's backward already summed, on the expert's rank, the
  gradient of every token routed to it from the whole ep group; reducing over ``edp``
  completes the sum over the data-parallel group, so the mean divides by the dp size
  (not the edp size).
* Gradient norm: stages 1–2 sum squared shard norms over ``dp`` (each expert shard is
  held by exactly one dp rank: dp = ep × edp); stage 0 holds whole local experts, whose
  squared norms are summed over ``ep``.
* Stage 3 (partitioned parameters) is refused by name.
"""

from __future__ import annotations

import torch
from torch import nn

from zeal.config import ConfigError
from zeal.dist.comm import Comm
from zeal.moe.layer import is_expert_param
from zeal.zero.grad_sync import GradReducer
from zeal.zero.units import FlatUnit, build_bucket_units


def split_expert_groups(groups: list[list[nn.Parameter]]) -> tuple[list[list[nn.Parameter]], list[list[nn.Parameter]]]:
    """Each optimizer group's parameters → (non-expert, expert), group positions kept."""
    dense = [[p for p in g if not is_expert_param(p)] for g in groups]
    experts = [[p for p in g if is_expert_param(p)] for g in groups]
    return dense, experts


def refuse_partitioned(groups: list[list[nn.Parameter]]) -> None:
    """Stage 3 keeps parameters partitioned over dp; experts would need their own
    gather groups, which zeal does not build."""
    if any(is_expert_param(p) for g in groups for p in g):
        raise ConfigError("zero_optimization.stage 3 with MoE expert parameters is not supported; "
                          "use stage 0, 1 or 2 (expert state is partitioned over the expert-data group)")


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

