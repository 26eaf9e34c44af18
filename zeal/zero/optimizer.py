"""The ZeRO optimizer step: fp32 master weights for the slice each rank owns.

Stage 0 keeps a master for the whole model; stages 1–3 only for this rank's shard
of every unit. An ordinary ``torch.optim`` optimizer runs over these flat masters
(every supported optimizer is elementwise, so a flat shard updates exactly as the
parameters it covers). After the update the new values go back to the model:
stage 0 copies, stages 1–2 copy the shard and all-gather the unit, stage 3 copies
into the persistent shard (and refreshes persistent units).

When the compute dtype is fp32 the master *is* the parameter storage (a view),
so no second copy exists. The global gradient norm is the square root of the
sum over ranks of the squared norms of the owned slices (padding is zero and
tied parameters live in one unit, so nothing is counted twice).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from zeal.dist.comm import Comm
from zeal.precision.loss_scaler import LossScaler
from zeal.zero.grad_sync import GradReducer
from zeal.zero.units import FlatUnit


class ZeroOptimizer:
    """Owns masters and the inner ``torch.optim`` optimizer (exposed as ``.optimizer``)."""

    def __init__(self, units: list[FlatUnit], reducer: GradReducer, comm: Comm, stage: int,
                 inner: torch.optim.Optimizer, clip: float, scaler: LossScaler | None) -> None:
        self.units = [u for u in units if u.trainable]
        self.reducer, self.comm, self.stage = reducer, comm, stage
        self.clip, self.scaler = clip, scaler
        self.optimizer = inner
        self.masters: list[nn.Parameter] = []
        for u in self.units:
            src = u.full if stage == 0 else u.shard
            if u.dtype == torch.float32:
                m = nn.Parameter(src, requires_grad=True)  # shares storage with the model
            else:
                m = nn.Parameter(src.detach().float().clone(), requires_grad=True)
            self.masters.append(m)
        self.last_grad_norm: float | None = None
        self.skipped_steps = 0

    def bind(self, groups: list[dict]) -> None:
        """Point the inner optimizer's param groups at the masters (group by unit.group)."""
        for g in groups:
            g["params"] = []
        for u, m in zip(self.units, self.masters):
            groups[u.group]["params"].append(m)
        self.optimizer.state.clear()

    def step(self) -> bool:
        """One update from the reduced gradients. Returns False when the step was
        skipped for an fp16 overflow (on every rank alike)."""
        for u, m in zip(self.units, self.masters):
            g = self.reducer.reduced_grad(u)
            m.grad = g if g.dtype == torch.float32 else g.float()
        grads = [m.grad for m in self.masters]
        if self.scaler is not None:
            inv = 1.0 / self.scaler.scale
            for g in grads:
                g.mul_(inv)
            bad = any(not torch.isfinite(g).all() for g in grads)
            bad = self.comm.all_reduce_scalar(1.0 if bad else 0.0, "max") > 0
            self.scaler.update(bad)
            if bad:
                self.skipped_steps += 1
                self.last_grad_norm = float("inf")
                self._drop_grads()
                return False
        sq = sum(float(g.double().pow(2).sum()) for g in grads) if grads else 0.0
        if self.stage > 0:
            sq = self.comm.all_reduce_scalar(sq, "sum")
        norm = math.sqrt(sq)
        self.last_grad_norm = norm
        if self.clip > 0:
            coef = self.clip / (norm + 1e-6)
            if coef < 1.0:
                for g in grads:
                    g.mul_(coef)
        self.optimizer.step()
        self._drop_grads()
        self._write_back()
        return True

    def _drop_grads(self) -> None:
        for m in self.masters:
            m.grad = None

    @torch.no_grad()
    def _write_back(self) -> None:
        for u, m in zip(self.units, self.masters):
            if self.stage == 0:
                if m.data_ptr() != u.full.data_ptr():
                    u.full.copy_(m)
            elif self.stage in (1, 2):
                if m.data_ptr() != u.shard.data_ptr():
                    u.shard.copy_(m)
                self.comm.all_gather(u.full, u.shard.clone(), "param")
            else:
                if m.data_ptr() != u.shard.data_ptr():
                    u.shard.copy_(m)

    def nbytes(self) -> int:
        """Persistent optimizer bytes: separate masters plus optimizer state tensors
        (0-dim tensors such as Adam's step counter are not counted)."""
        total = 0
        for u, m in zip(self.units, self.masters):
            src = u.full if self.stage == 0 else u.shard
            if m.data_ptr() != src.data_ptr():
                total += m.numel() * m.element_size()
            for v in self.optimizer.state.get(m, {}).values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    total += v.numel() * v.element_size()
        return total
