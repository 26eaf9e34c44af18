"""ADMM for N:M sparsity (NxMTransformer), over any set of tensors.

The constrained problem ``min f(W) s.t. W ∈ S`` (S: the N:M-sparse tensors) is split
with an auxiliary ``Z`` and a scaled dual ``U``:

* W-step: ordinary optimizer steps on ``f(W) + ρ/2·‖W − Z + U‖²`` (the penalty's
  gradient ``ρ(W − Z + U)`` is added to W's gradient: :meth:`ADMM.add_penalty_grad_`,
  or the penalty is added to the loss: :meth:`ADMM.penalty`);
* Z-step (every few optimizer steps): ``Z = Π_S(W + U)`` (:func:`~zeal.compression.nm.nm_project`);
* dual step: ``U += W − Z``.

Residuals: primal ``‖W − Z‖`` (how far W is from feasible; also relative to ``‖W‖``),
dual ``ρ‖Z − Z_prev‖`` (how much the target still moves); both go to zero as ADMM converges. ``ρ`` grows by
``growth`` at every Z-step up to ``rho_max``; the scaled dual is rescaled by
``ρ_old/ρ_new`` so that the unscaled multiplier ``ρU`` is unchanged.

Two options beyond the Euclidean core:

* ``metric``: a positive weight ``D`` per tensor (broadcastable, e.g. one per input
  column): the penalty becomes ``ρ/2·Σ D·(W − Z + U)²`` and ``project`` must then be the
  projection in that metric (keep, per group, the entries of largest ``D·w²``). With
  ``D_j = ‖X_j‖²`` (the squared norm of input feature j over calibration tokens) that
  projection is Wanda's score ``|w|·‖X_j‖``: the diagonal of the layer's ``XᵀX``;
* :meth:`ADMM.prox_`: the W-step's penalty applied as its exact proximal step after the
  optimizer's step, ``W ← (W + sρD(Z − U)) / (1 + sρD)``, instead of through the gradient.
  An adaptive optimizer (Adam) normalises a gradient, so a penalty gradient moves each
  weight by about the learning rate per step whatever ``ρ``; the proximal step pulls by
  the fraction ``sρD/(1 + sρD)`` (decoupled, as AdamW decouples weight decay) and reaches
  the constraint set in a few steps once ``sρ`` is about one.

The tensors may be whole parameters or the fp32 master shards of ZeRO: ``project(key,
values)`` says how to project one of them (for a shard it knows the N:M segments and
may gather), ``region[key]`` which of its elements are sparsified (the penalty must not
touch the others), and ``reduce`` sums the residuals' squares over ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["ADMM", "ADMMResiduals", "RhoSchedule"]


@dataclass(frozen=True)
class RhoSchedule:
    """``ρ`` at the k-th Z-step: ``min(rho · growth**k, rho_max)``."""

    rho: float = 1e-3
    growth: float = 1.0
    rho_max: float = 1.0

    def at(self, k: int) -> float:
        return min(self.rho * self.growth ** k, self.rho_max)


@dataclass(frozen=True)
class ADMMResiduals:
    """After a Z-step: the primal and dual residuals and the ``ρ`` now in force."""

    primal: float
    dual: float
    rho: float
    primal_rel: float = math.nan  # ‖W − Z‖ / ‖W‖ (over the sparsified elements)


class ADMM:
    """Z and U for every tensor of ``tensors`` (live references, updated by an optimizer).

    Invariant: ``Z[k]`` is feasible (N:M inside ``region[k]``, equal to W outside it) and
    ``U[k]`` is zero outside the region. Communication: only what ``project`` and
    ``reduce`` do."""

    def __init__(self, tensors: dict[str, torch.Tensor], project: Callable[[str, torch.Tensor], torch.Tensor],
                 schedule: RhoSchedule, region: dict[str, torch.Tensor] | None = None,
                 reduce: Callable[[float], float] = float, metric: dict[str, torch.Tensor] | None = None) -> None:
        self.tensors, self.project, self.schedule = tensors, project, schedule
        self.region = region or {}
        self.metric = metric or {}
        self.reduce = reduce
        self.updates = 0
        self.rho = schedule.at(0)
        with torch.no_grad():
            self.Z = {k: project(k, w.detach().float()) for k, w in tensors.items()}
            self.U = {k: torch.zeros_like(z) for k, z in self.Z.items()}

    def _in_region(self, k: str, t: torch.Tensor) -> torch.Tensor:
        r = self.region.get(k)
        return t if r is None else t * r

    def _weighted(self, k: str, t: torch.Tensor) -> torch.Tensor:
        d = self.metric.get(k)
        return t if d is None else t * d

    def penalty(self) -> torch.Tensor:
        """``Σ ρ/2·D·(W − Z + U)²`` over the sparsified elements (differentiable in W)."""
        total = torch.zeros(())
        for k, w in self.tensors.items():
            d = self._in_region(k, w.float() - self.Z[k] + self.U[k])
            total = total + 0.5 * self.rho * self._weighted(k, d.pow(2)).sum()
        return total

    @torch.no_grad()
    def add_penalty_grad_(self) -> None:
        """Add the penalty's gradient ``ρD(W − Z + U)`` to every tensor's ``.grad``."""
        for k, w in self.tensors.items():
            g = self._weighted(k, self._in_region(k, w.float() - self.Z[k] + self.U[k])).mul_(self.rho)
            if w.grad is None:
                w.grad = g.to(w.dtype)
            else:
                w.grad.add_(g.to(w.grad.dtype))

    @torch.no_grad()
    def prox_(self, step: float = 1.0) -> None:
        """The penalty's proximal step of size ``step`` on every tensor, in place:
        ``W ← argmin_V ρ/2·‖V − Z + U‖²_D + ‖V − W‖²/(2·step)``
        ``= (W + step·ρD(Z − U)) / (1 + step·ρD)`` inside the region, W unchanged outside."""
        for k, w in self.tensors.items():
            c = self._in_region(k, self._weighted(k, torch.full_like(self.Z[k], step * self.rho)))
            wf = w.detach().float()
            w.data.copy_(((wf + c * (self.Z[k] - self.U[k])) / (1 + c)).to(w.dtype))

    @torch.no_grad()
    def update(self) -> ADMMResiduals:
        """One Z-step and dual step; then ``ρ`` moves along its schedule."""
        primal = dual = norm = 0.0
        for k, w in self.tensors.items():
            wf = w.float()
            z = self.project(k, wf + self.U[k])
            dual += float((z - self.Z[k]).pow(2).sum())
            self.U[k].add_(self._in_region(k, wf - z))
            primal += float(self._in_region(k, wf - z).pow(2).sum())
            norm += float(self._in_region(k, wf).pow(2).sum())
            self.Z[k] = z
        rho = self.rho
        self.updates += 1
        self.rho = self.schedule.at(self.updates)
        if self.rho != rho:
            for u in self.U.values():
                u.mul_(rho / self.rho)
        primal = math.sqrt(self.reduce(primal))
        norm = math.sqrt(self.reduce(norm))
        return ADMMResiduals(primal, rho * math.sqrt(self.reduce(dual)), self.rho, primal / norm if norm else 0.0)
