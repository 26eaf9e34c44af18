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
from typing import Any, Protocol

import torch
from torch import nn

from zeal.dist.comm import Comm
from zeal.precision.loss_scaler import LossScaler
from zeal.zero.grad_sync import GradReducer
from zeal.zero.offload.staging import Staging
from zeal.zero.shard_home import DiskShards, MemoryShards
from zeal.zero.stages import ZeroStage, resolve_stage
from zeal.zero.units import FlatUnit


def unscale_check_clip(grads: list[torch.Tensor], comm: Comm, stage: ZeroStage, scaler: LossScaler | None,
                       clip: float, grad_norm: GradNorm | None = None, across: Comm | None = None,
                       spread: list[tuple[list[bool], Comm]] | None = None) -> tuple[bool, float]:
    """Unscale (fp16), detect overflow on any rank, clip by the global norm — in place.
    Returns (step may proceed, global norm before clipping; inf on overflow).
    Stage 0 holds the whole mean gradient on every rank, so its norm needs no
    communication; stages 1–3 sum squared shard norms over ranks. ``grad_norm`` (a
    :class:`GradNorm`, e.g. tensor parallelism's) gives this rank's squared norm when the
    plain sum of squares is not it, and spreads overflow flags over the ranks it spans.
    ``across`` (the pipeline stages, each holding other parameters) sums the flag and the
    norm over it too. ``spread``: ``(flags, Comm)`` for gradients of a CommGroup
    (:mod:`zeal.zero.groups`): at stage 0 their squared norms are summed over the Comm
    (its ranks hold the group's other parameters); at stages 1–3 the dp sum covers them."""
    if scaler is not None:
        inv = 1.0 / scaler.scale
        for g in grads:
            g.mul_(inv)
        bad = not all_finite(grads)
        bad = comm.all_reduce_scalar(1.0 if bad else 0.0, "max") > 0
        if grad_norm is not None:
            bad = grad_norm.any(bad)
        if across is not None:
            bad = across.all_reduce_scalar(1.0 if bad else 0.0, "max") > 0
        scaler.update(bad)
        if bad:
            return False, float("inf")
    # per-tensor fp32 norms (no full-size temporaries), summed in double
    if grad_norm is not None:
        sq = grad_norm.sq(grads)
        for flags, over in (spread or []) if not stage.norm_needs_reduce() else []:
            if over.active:  # stage 0: each rank holds only its share of the group's parameters
                part = grad_norm.sq([g if f else g.new_empty(0) for g, f in zip(grads, flags)])
                sq = sq - part + over.all_reduce_scalar(part, "sum")
    else:
        sqs = squared_norms(grads)
        sq = sum(sqs)
        for flags, over in (spread or []) if not stage.norm_needs_reduce() else []:
            part = sum(s for s, f in zip(sqs, flags) if f)
            sq = sq - part + over.all_reduce_scalar(part, "sum")
    if stage.norm_needs_reduce():
        sq = comm.all_reduce_scalar(sq, "sum")
    if across is not None:
        sq = across.all_reduce_scalar(sq, "sum")
    norm = math.sqrt(sq)
    if clip > 0:
        coef = clip / (norm + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
    return True, norm


def squared_norms(grads: list[torch.Tensor]) -> list[float]:
    """Each tensor's squared norm (taken in fp32, squared in double) with one host sync for
    all of them: the per-tensor norms are stacked on the device and read back once."""
    if not grads:
        return []
    dev = grads[0].device
    norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32).to(dev) for g in grads])
    return (norms.double() ** 2).tolist()


def all_finite(grads: list[torch.Tensor]) -> bool:
    """Whether no tensor holds an inf or NaN, with one host sync for all of them."""
    if not grads:
        return True
    dev = grads[0].device
    return bool(torch.stack([torch.isfinite(g).all().to(dev) for g in grads]).all())


def spread_flags(opt: Any) -> list[tuple[list[bool], Comm]]:
    """``unscale_check_clip``'s ``spread`` for an optimizer's units and reducer."""
    return [([u.comm_group == i for u in opt.units], over) for i, over in getattr(opt.reducer, "spread", [])]


class GradNorm(Protocol):
    """This rank's squared gradient norm when it is not the plain sum of squares (tensor
    parallelism: split parameters summed over tp), and overflow flags spread over the
    ranks it spans. Given to the optimizer at construction."""

    def sq(self, grads: list[torch.Tensor]) -> float: ...

    def any(self, flag: bool) -> bool: ...


def hosted_units(n: int, ratio: float) -> list[bool]:
    """Which of ``n`` units keep their optimizer in host memory under
    ``offload_optimizer.ratio``: the last ``ratio`` share of them, counted as DeepSpeed's
    partial offload counts its sub-groups (unit ``i`` is on the host when
    ``i >= int((1 - ratio) * n)``); the others are updated beside the model."""
    first = int((1.0 - ratio) * n) if ratio > 0 else n
    return [i >= first for i in range(n)]


class ZeroOptimizer:
    """Owns masters and the inner ``torch.optim`` optimizer (exposed as ``.optimizer``).
    ``grad_norm``: see :func:`unscale_check_clip` (None: the plain sum of squares)."""

    def __init__(self, units: list[FlatUnit], reducer: GradReducer, comm: Comm, stage: ZeroStage | int,
                 inner: torch.optim.Optimizer, clip: float, scaler: LossScaler | None,
                 home: MemoryShards | DiskShards | None = None, master_device: torch.device | None = None,
                 grad_norm: GradNorm | None = None, staging: Staging | None = None,
                 offload_ratio: float = 1.0) -> None:
        self.units = [u for u in units if u.trainable]
        # which units' masters and moments live in host memory (``master_device``): all of them,
        # or the last ``offload_ratio`` share under partial offload (ZeRO-Offload++)
        self.hosted = hosted_units(len(self.units), offload_ratio if master_device is not None else 0.0)
        # host masters across a device boundary (ZeRO-Offload on an accelerator, or forced)
        self.staging = staging if staging is not None and master_device is not None and staging.crosses else None
        self.reducer, self.comm, self.stage = reducer, comm, resolve_stage(stage)
        self.clip, self.scaler = clip, scaler
        self.home = home or MemoryShards()
        self.optimizer = inner
        self.masters: list[nn.Parameter] = []
        for u, hosted in zip(self.units, self.hosted):
            src = self.stage.model_slice(u, self.home)
            device = (master_device if hosted else None) or src.device
            if self.staging is not None and hosted:  # fp32 host masters (pinned when asked), downloaded below
                m = nn.Parameter(self.staging.to_host(src, dtype=torch.float32), requires_grad=True)
            elif u.dtype == torch.float32 and not self.home.lends and device == src.device:
                m = nn.Parameter(src, requires_grad=True)  # shares storage with the model
            else:  # a separate fp32 master (mixed precision, or offloaded)
                m = nn.Parameter(src.detach().to(device=device, dtype=torch.float32, copy=True), requires_grad=True)
            if self.stage.partitions_optimizer:
                self.home.done(u)
            self.masters.append(m)
        if self.staging is not None:
            self.staging.wait_host()
        self.last_grad_norm: float | None = None
        self.skipped_steps = 0
        self.grad_norm = grad_norm
        self.across: Comm | None = None  # pipeline stages: see unscale_check_clip

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
        self._take_grads()
        grads = [m.grad for m in self.masters]
        ok, self.last_grad_norm = unscale_check_clip(grads, self.comm, self.stage, self.scaler, self.clip,
                                                         self.grad_norm, self.across, spread_flags(self))
        if not ok:
            self.skipped_steps += 1
            self._drop_grads()
            return False
        self.optimizer.step()
        self._drop_grads()
        self.write_back()
        return True

    def _take_grads(self) -> None:
        """The reduced gradients as the masters' fp32 grads; across a boundary, every unit's
        download is issued first (they overlap), then one host wait, then the upcast on the host."""
        hosts = {}
        for i, u in enumerate(self.units):
            if self.staging is not None and self.hosted[i]:
                hosts[i] = self.staging.to_host(self.reducer.reduced_grad(u), key=("grad", u.index))
            else:
                self.masters[i].grad = self.reducer.reduced_grad(u).to(device=self.masters[i].device,
                                                                        dtype=torch.float32)
        if not hosts:
            return
        self.staging.wait_host()
        for i, h in hosts.items():
            self.masters[i].grad = h if h.dtype == torch.float32 else h.float()

    def _drop_grads(self) -> None:
        for m in self.masters:
            m.grad = None

    def write_back(self) -> None:
        """Put the masters' values into the model (every rank sees the new parameters)."""
        self.stage.write_back(self.units, self.masters, self.comm, self.home, self.staging, self.hosted)

    def nbytes(self) -> int:
        """Persistent optimizer bytes: separate masters plus optimizer state tensors
        (0-dim tensors such as Adam's step counter are not counted)."""
        total = 0
        for u, m in zip(self.units, self.masters):
            src = u.shard if self.stage.partitions_optimizer else u.full
            if m.data_ptr() != src.data_ptr() or self.home.lends:
                total += m.numel() * m.element_size()
            for v in self.optimizer.state.get(m, {}).values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    total += v.numel() * v.element_size()
        return total
