"""ADMM on every linear's output reconstruction: N:M masks and weights from calibration data.

For a linear with weight ``W0`` (``[out, in]``) and calibration inputs ``X`` (``[tokens,
in]``), the N:M-sparse weight whose outputs stay closest to the dense ones solves

    min_W ½‖X(W − W0)ᵀ‖²  s.t.  W ∈ S   (S: N of every M along ``in``),

per row ``½(w − w0)ᵀH(w − w0)`` with ``H = XᵀX`` (damped by ``damp·mean(diag H)`` and
scaled so that its mean diagonal is 1, so that ``ρ`` means the same in every layer).
:class:`~zeal.compression.admm.ADMM` runs it with the W-step solved exactly,

    W = (W0·H + ρ(Z − U))·(H + ρI)⁻¹

(one eigendecomposition of ``H`` serves every ``ρ``), the Z-step the Euclidean N:M
projection of ``W + U``, the dual step ``U += W − Z`` and ``ρ`` growing geometrically
from ``rho`` to ``rho_max``, so that the support settles while the quadratic still
steers it (the approach of ALPS, Meng et al. 2024, for one-shot pruning). Then the
support of ``Z`` is fixed and the kept weights are re-fitted on the same objective by
conjugate gradients (rows are independent: one CG per row, batched). By default the
blocks are pruned in model order, each on inputs that have passed through the blocks
already pruned (sequential, as SparseGPT calibrates).

Against Wanda (``|W|·‖X_j‖``, the diagonal of ``H`` only) this uses the whole of ``H``:
how the input features co-vary decides both which weights go and how the kept ones
compensate. It spends no training steps, so the whole fine-tuning budget goes to masked
training on the final support.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from torch import nn

from zeal.compression.admm import ADMM, ADMMResiduals, RhoSchedule
from zeal.compression.modules import feed_inputs
from zeal.compression.nm import nm_mask

__all__ = ["collect_grams", "reconstruction_admm", "target_groups"]


def collect_grams(targets: dict[str, nn.Linear], run: Callable[[], None]) -> dict[str, torch.Tensor]:
    """``XᵀX / tokens`` (fp32, ``[in, in]``) of every target linear's input while ``run()``
    feeds the calibration data through the model."""
    grams = {k: torch.zeros(lin.in_features, lin.in_features) for k, lin in targets.items()}
    tokens = dict.fromkeys(targets, 0)

    def consume(name: str, x: torch.Tensor) -> None:
        x = x.float()
        grams[name].addmm_(x.T, x)
        tokens[name] += x.shape[0]

    feed_inputs(targets, run, consume)
    missing = [k for k, t in tokens.items() if t == 0]
    if missing:
        raise ValueError(f"no calibration input reached {missing[0]!r}: it is not called by the model's forward")
    return {k: g / tokens[k] for k, g in grams.items()}


class _Quadratic:
    """One linear's objective ``½ tr((W − W0)·H·(W − W0)ᵀ)``, H damped and normalised."""

    def __init__(self, w0: torch.Tensor, gram: torch.Tensor, damp: float) -> None:
        h = gram.double()
        h = h + damp * float(h.diagonal().mean()) * torch.eye(h.shape[0], dtype=h.dtype)
        h = h / float(h.diagonal().mean())
        evals, self.q = torch.linalg.eigh(h)
        self.evals, self.q = evals.float(), self.q.float()
        self.h = h.float()
        self.target = w0 @ self.h  # W0·H

    def solve(self, z_minus_u: torch.Tensor, rho: float) -> torch.Tensor:
        """The W-step: ``(W0·H + ρ(Z − U))·(H + ρI)⁻¹``."""
        rhs = (self.target + rho * z_minus_u) @ self.q
        return (rhs / (self.evals + rho)) @ self.q.T

    def refit(self, w: torch.Tensor, mask: torch.Tensor, iters: int) -> torch.Tensor:
        """Minimise the objective over the weights inside ``mask`` (the rest zero), from
        ``w``: conjugate gradients, one per row."""
        m = mask.to(w.dtype)
        w = w * m
        r = (self.target - w @ self.h) * m  # minus the gradient
        p = r.clone()
        rr = (r * r).sum(1, keepdim=True)
        for _ in range(iters):
            hp = (p @ self.h) * m
            alpha = rr / (p * hp).sum(1, keepdim=True).clamp_min(1e-30)
            w = w + alpha * p
            r = r - alpha * hp
            rr_new = (r * r).sum(1, keepdim=True)
            p = r + (rr_new / rr.clamp_min(1e-30)) * p
            rr = rr_new
        return w * m

    def value(self, w: torch.Tensor, w0: torch.Tensor) -> float:
        d = w - w0
        return 0.5 * float(((d @ self.h) * d).sum())


def _combine(per_target: list[list[ADMMResiduals]]) -> list[ADMMResiduals]:
    """Residuals over all targets after each iteration (root of the summed squares)."""
    out = []
    for rows in zip(*per_target, strict=True):
        primal = math.sqrt(sum(r.primal ** 2 for r in rows))
        norm = math.sqrt(sum((r.primal / r.primal_rel) ** 2 for r in rows if r.primal_rel > 0))
        out.append(ADMMResiduals(primal, math.sqrt(sum(r.dual ** 2 for r in rows)), rows[0].rho,
                                 primal / norm if norm else 0.0))
    return out


def target_groups(targets: dict[str, nn.Linear]) -> list[dict[str, nn.Linear]]:
    """The targets grouped by block, in model order: a block is the name up to its last
    numeric component (``model.layers.3`` for ``model.layers.3.mlp.up_proj``); a target
    with no numeric component is a group of its own."""
    groups: dict[str, dict[str, nn.Linear]] = {}
    for k, lin in targets.items():
        groups.setdefault(target_groups_prefix({k: lin}), {})[k] = lin
    return list(groups.values())


def _layer_chain(targets_groups: list[dict[str, nn.Linear]], model: nn.Module | None
                 ) -> tuple[nn.ModuleList, list[int]] | None:
    """The layer list and each group's index in it, when every group is one layer of the
    same ``nn.ModuleList`` (``model.layers.3`` …) in increasing order; else None."""
    if model is None:
        return None
    stack, idx = None, []
    for group in targets_groups:
        prefix = target_groups_prefix(group)
        parent, _, last = prefix.rpartition(".")
        if not last.isdigit():
            return None
        try:
            mod = model.get_submodule(parent) if parent else model
        except AttributeError:
            return None
        if not isinstance(mod, nn.ModuleList) or (stack is not None and mod is not stack) or int(last) >= len(mod):
            return None
        stack = mod
        idx.append(int(last))
    if stack is None or idx != sorted(set(idx)):
        return None
    return stack, idx


def target_groups_prefix(group: dict[str, nn.Linear]) -> str:
    """The block name of a group from :func:`target_groups` (its targets' common prefix)."""
    parts = next(iter(group)).split(".")
    idx = [i for i, part in enumerate(parts) if part.isdigit()]
    return ".".join(parts[:idx[-1] + 1]) if idx else next(iter(group))


def _capture_inputs(layer: nn.Module, calibrate: Callable[[], None]) -> list[tuple[tuple, dict]]:
    """The (args, kwargs) of every call of ``layer`` while ``calibrate()`` runs."""
    seen: list[tuple[tuple, dict]] = []

    def hook(_mod: nn.Module, args: tuple, kwargs: dict) -> None:
        seen.append((tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args), dict(kwargs)))

    handle = layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        calibrate()
    finally:
        handle.remove()
    if not seen:
        raise ValueError("no calibration input reached the first pruned layer")
    return seen


def _fmt_s(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


@torch.no_grad()
def reconstruction_admm(targets: dict[str, nn.Linear], calibrate: Callable[[], None], n: int, m: int,
                        sequential: bool = True, iters: int = 60, rho: float = 0.01, rho_max: float = 100.0,
                        damp: float = 0.01, refit_iters: int = 30, model: nn.Module | None = None,
                        log=print) -> tuple[dict[str, torch.Tensor], list[ADMMResiduals]]:
    """Prune every target linear to N:M in place by ADMM on its output reconstruction
    (see the module docstring), one linear at a time. ``calibrate()`` feeds the calibration
    data through the model; with ``sequential`` each block (:func:`target_groups`) is
    calibrated on the outputs of the blocks already pruned (their errors are compensated
    downstream, as SparseGPT does) and only one block's Gram matrices are held; without,
    once for all targets on the dense model. With ``model`` given and the blocks the layers
    of one ``nn.ModuleList`` (``model.layers.i``), the sequential pass runs the model once
    to record the first block's inputs and then each layer once on the recorded inputs (the
    outputs of the previous, pruned layer), instead of a whole forward per block: the same
    inputs at a fraction of the cost. A progress line per block gives the time so far and
    an estimate of the time left. Returns the masks (by ``<module>.weight``) and the
    residuals after each Z-step, over all targets."""
    if iters < 1 or not 0 < rho <= rho_max:
        raise ValueError(f"reconstruction ADMM needs iters >= 1 and 0 < rho <= rho_max, got {iters}, {rho}, {rho_max}")
    growth = (rho_max / rho) ** (1 / max(1, iters - 1))
    masks, per_target, before, after = {}, [], 0.0, 0.0
    groups = target_groups(targets) if sequential else [targets]
    chain = _layer_chain(groups, model) if sequential else None
    inputs = _capture_inputs(chain[0][chain[1][0]], calibrate) if chain else None
    layer_of = dict(zip(chain[1], groups, strict=True)) if chain else {}
    weights_total = sum(lin.weight.numel() for lin in targets.values())
    weights_done, t0 = 0, time.perf_counter()

    def prune_group(group: dict[str, nn.Linear], grams: dict[str, torch.Tensor]) -> None:
        nonlocal before, after
        for k, lin in group.items():
            w0 = lin.weight.detach().float().clone()
            quad = _Quadratic(w0, grams.pop(k), damp)
            work = w0.clone()
            admm = ADMM({k: work}, lambda _k, v: v * nm_mask(v.abs(), n, m), RhoSchedule(rho, growth, rho_max))
            history = []
            for _ in range(iters):
                work.copy_(quad.solve(admm.Z[k] - admm.U[k], admm.rho))
                history.append(admm.update())
            per_target.append(history)
            mask = nm_mask(admm.Z[k].abs(), n, m)
            fitted = quad.refit(admm.Z[k], mask, refit_iters)
            before += quad.value(admm.Z[k], w0)
            after += quad.value(fitted, w0)
            lin.weight.copy_(fitted.to(lin.weight.dtype))
            masks[f"{k}.weight"] = mask

    def progress(i: int, group: dict[str, nn.Linear]) -> None:
        nonlocal weights_done
        weights_done += sum(lin.weight.numel() for lin in group.values())
        spent = time.perf_counter() - t0
        left = spent * (weights_total - weights_done) / max(weights_done, 1)
        log(f"admm block {i + 1}/{len(groups)} ({target_groups_prefix(group) if sequential else 'all'}, "
            f"{len(group)} linears): {_fmt_s(spent)} so far, about {_fmt_s(left)} left")

    if chain is not None:
        stack, idx = chain
        done = 0
        for li in range(idx[0], idx[-1] + 1):
            layer = stack[li]
            if li in layer_of:
                group = layer_of[li]
                prune_group(group, collect_grams(group, lambda lay=layer, ins=inputs: [lay(*a, **kw) for a, kw in ins]))
                progress(done, group)
                done += 1
            if li < idx[-1]:  # the next layer's inputs: this (pruned) layer's outputs
                inputs = [((layer(*a, **kw), *a[1:]), kw) for a, kw in inputs]
    else:
        for i, group in enumerate(groups):
            prune_group(group, collect_grams(group, calibrate))
            progress(i, group)
    combined = _combine(per_target)
    for it in sorted({0, *range(9, iters, 10), iters - 1}):
        r = combined[it]
        log(f"reconstruction admm {it + 1}/{iters}: primal {r.primal_rel:.2%} of |W|, dual {r.dual:.3e}, "
            f"rho {r.rho:.3g}")
    log(f"reconstruction admm: refit of the kept weights took the output error from {before:.4g} to {after:.4g}")
    return masks, combined
