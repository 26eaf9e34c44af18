"""Keeping masked weights at zero, and running ADMM, inside the optimizer's step.

:class:`MaskEnforcer` hangs on a ``torch.optim`` optimizer (``register_step_post_hook``):
right after every step it multiplies each masked tensor and its optimizer moments
(tensors of its shape: Adam's ``exp_avg``/``exp_avg_sq``, SGD's momentum) by the mask.
A pruned weight is then exactly zero after every step whatever the update did (weight
decay included), and a reset moment cannot revive it. Inside the ZeRO engine it runs
over the fp32 master shards, *before* ZeRO writes the masters back into the model, so
the model copy is masked too with no extra communication.

:class:`SparsityHook` is the engine's step hook (:mod:`zeal.train.hooks`) for N:M
sparsity learned during training: an ADMM phase (``penalty="prox"``: the penalty's exact
proximal step, :meth:`~zeal.compression.admm.ADMM.prox_`, on the master shards by an
optimizer post-step hook, i.e. after the update and before ZeRO writes the masters back;
``"grad"``: the penalty's gradient added to the master shards' gradients by a pre-step
hook, i.e. after unscaling and clipping, which see the task gradient only; either way
elementwise on each rank's shard, no communication; Z/U are updated every ``admm_interval``
optimizer steps), then hard pruning at ``prune_step`` (masks from the
masters, masters and moments masked, the model re-synchronised) and masked retraining.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from zeal.compression.admm import ADMM, ADMMResiduals, RhoSchedule
from zeal.compression.nm import nm_mask
from zeal.compression.sharded import ShardedParams

log = logging.getLogger("zeal")

__all__ = ["MaskEnforcer", "SparsityHook", "SparsitySchedule", "mask_state_"]


@torch.no_grad()
def mask_state_(optimizer: torch.optim.Optimizer, param: torch.Tensor, mask: torch.Tensor) -> None:
    """Multiply ``param`` and every optimizer moment of its shape by ``mask`` (in place)."""
    m = mask.view(param.shape).to(param.dtype)
    param.data.mul_(m)
    for v in optimizer.state.get(param, {}).values():
        if isinstance(v, torch.Tensor) and v.shape == param.shape:
            v.mul_(m.to(v.dtype))


class MaskEnforcer:
    """``masks[i]`` (bool, ``params[i]``'s numel) re-applied after every optimizer step.

    Invariant: between steps, ``params[i][~masks[i]] == 0`` and so are their moments."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], masks: list[torch.Tensor]) -> None:
        self.optimizer, self.pairs = optimizer, list(zip(params, masks))
        self.enforce()
        self._handle = optimizer.register_step_post_hook(lambda *_: self.enforce())

    def enforce(self) -> None:
        for p, mask in self.pairs:
            mask_state_(self.optimizer, p, mask)

    def remove(self) -> None:
        self._handle.remove()


@dataclass(frozen=True)
class SparsitySchedule:
    """When things happen, counted in applied optimizer steps."""

    method: str = "magnitude"  # "magnitude" or "admm"
    prune_step: int = 0  # hard pruning after this many steps (0: at once)
    admm_interval: int = 1  # Z/U update every this many steps (ADMM phase)
    rho: RhoSchedule = RhoSchedule()
    penalty: str = "grad"  # "prox" (proximal step after the optimizer step) or "grad"


class SparsityHook:
    """N:M sparsity of the engine's sparsified parameters (a step hook). ``history``
    holds the ADMM residuals; ``masks`` the flat bool masks per master key once pruned.
    Communication: none per step; an all-gather of a unit's masters at Z-steps and at
    pruning only where a partition boundary cuts a group (see :mod:`.sharded`)."""

    def __init__(self, sparse: ShardedParams, optimizer: torch.optim.Optimizer, write_back, schedule: SparsitySchedule,
                 verbose: bool = False) -> None:
        self.sparse, self.optimizer, self.write_back = sparse, optimizer, write_back
        self.schedule, self.verbose = schedule, verbose
        self.steps = 0
        self.history: list[ADMMResiduals] = []
        self.masks: dict[str, torch.Tensor] = {}
        self.enforcer: MaskEnforcer | None = None
        self.admm: ADMM | None = None
        self._pre = self._once = None
        self._remade = False
        if schedule.method == "admm" and schedule.prune_step > 0:
            self.admm = ADMM(sparse.masters(), self._project, schedule.rho, sparse.region(), sparse.sum_over_ranks)
            if schedule.penalty == "prox":
                self._pre = optimizer.register_step_post_hook(lambda *_: self.admm.prox_())
            else:
                self._pre = optimizer.register_step_pre_hook(lambda *_: self.admm.add_penalty_grad_())
        elif schedule.prune_step == 0:
            self.prune()  # the first forward already sees the pruned weights
            # Masks are made again before the first update, from the masters as they are then:
            # the same masks (the projection is idempotent) unless a checkpoint was loaded after
            # initialize, whose zeros they then follow. (The hook stays registered, as a no-op,
            # until close(): a hook may not remove itself while the optimizer walks its hooks.)
            self._once = optimizer.register_step_pre_hook(lambda *_: self._prune_once())

    def _project(self, key: str, values: torch.Tensor) -> torch.Tensor:
        return self.sparse.apply(key, values, lambda t, d, name: t * nm_mask(t.abs(), *self._nm(name), d))

    def _nm(self, name: str) -> tuple[int, int]:
        for e in self.sparse.entries.values():
            for s in e.segments:
                if s.name == name:
                    return s.spec.n, s.spec.m
        raise KeyError(name)

    def _prune_once(self) -> None:
        if self._once is not None and not self._remade:
            self._remade = True
            self.enforcer.remove()
            self.prune(write_back=False)

    @torch.no_grad()
    def prune(self, write_back: bool = True) -> None:
        """Hard pruning: masks from the masters' magnitudes, masked retraining from now on
        (``write_back``: push the masked masters into the model now)."""
        if self._pre is not None:
            self._pre.remove()
            self._pre, self.admm = None, None
        regions = self.sparse.region()
        params, masks = [], []
        for k, e in self.sparse.entries.items():
            keep = self.sparse.apply(k, e.master, lambda t, d, name: nm_mask(t.abs(), *self._nm(name), d).to(t.dtype))
            self.masks[k] = torch.where(regions[k] > 0, keep != 0, torch.ones_like(keep, dtype=torch.bool))
            params.append(e.param)
            masks.append(self.masks[k])
        self.enforcer = MaskEnforcer(self.optimizer, params, masks)
        if write_back:
            self.write_back()

    def after_step(self, applied: bool) -> None:
        if not applied:
            return
        self.steps += 1
        if self.admm is not None and self.steps % self.schedule.admm_interval == 0:
            r = self.admm.update()
            self.history.append(r)
            if self.verbose:
                log.info("admm step %d: primal %.3e dual %.3e rho %.2e", self.steps, r.primal, r.dual, r.rho)
        if self.enforcer is None and self.schedule.prune_step > 0 and self.steps >= self.schedule.prune_step:
            self.prune()

    def close(self) -> None:
        for h in (self._pre, self._once):
            if h is not None:
                h.remove()
        if self.enforcer is not None:
            self.enforcer.remove()
