"""One-process compression of a model (what ``zeal compress`` runs).

1. prune to N:M: one-shot ``magnitude`` or ``wanda`` (activation norms from the
   calibration blocks), or ``admm`` (the first half of the step budget runs ADMM with
   AdamW on the calibration blocks, then the weights are projected);
2. fine-tune the remaining steps with the masks held (masked weights and their AdamW
   moments reset after every step) and, with ``bits``, quantization-aware (QAT);
   with no steps left, ``bits`` is post-training quantization through the same quantizer;
3. perplexity on the held-out blocks before and after.

Every method gets the same number of optimizer steps on the same data.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from zeal.compression.admm import ADMM, RhoSchedule
from zeal.compression.calibration import perplexity
from zeal.compression.hooks import MaskEnforcer
from zeal.compression.modules import (
    QuantSpec,
    apply_masks_,
    collect_input_norms,
    linear_targets,
    magnitude_masks,
    ptq_,
    swap_qat,
    wanda_masks,
)
from zeal.compression.nm import nm_project

__all__ = ["CompressJob", "CompressReport", "compress_model"]


@dataclass(frozen=True)
class CompressJob:
    """What to do (the ``zeal compress`` flags)."""

    n: int | None = 2  # None: no sparsity
    m: int = 4
    method: str = "magnitude"  # magnitude | wanda | admm
    bits: int | None = None
    group_size: int | None = None
    steps: int = 0
    lr: float = 1e-5
    batch: int = 2
    admm_interval: int = 2
    rho: RhoSchedule = RhoSchedule(1e-3, 1.5, 1.0)
    exclude: tuple[str, ...] = ("lm_head", "*.lm_head")


@dataclass
class CompressReport:
    ppl_before: float
    ppl_after: float
    seconds: float
    targets: list[str] = field(default_factory=list)
    admm_residuals: list[tuple[float, float]] = field(default_factory=list)


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x, labels=x)


def _batches(calib: torch.Tensor, batch: int):
    i = 0
    while True:
        yield calib[(torch.arange(batch) + i) % calib.shape[0]]
        i += batch


def _admm_phase(model: nn.Module, targets: dict, job: CompressJob, steps: int, data) -> list[tuple[float, float]]:
    weights = {f"{k}.weight": lin.weight for k, lin in targets.items()}
    admm = ADMM(weights, lambda _k, v: nm_project(v, job.n, job.m), job.rho)
    opt = torch.optim.AdamW(model.parameters(), lr=job.lr, weight_decay=0.0)
    history = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        _loss(model, next(data)).backward()
        admm.add_penalty_grad_()
        opt.step()
        if (step + 1) % job.admm_interval == 0 or step + 1 == steps:
            r = admm.update()
            history.append((r.primal, r.dual))
    return history


def _finetune(model: nn.Module, masks: dict[str, torch.Tensor], job: CompressJob, steps: int, data) -> None:
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=job.lr, weight_decay=0.0)
    enforcer = MaskEnforcer(opt, [params[k] for k in masks], list(masks.values())) if masks else None
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        _loss(model, next(data)).backward()
        opt.step()
    if enforcer is not None:
        enforcer.remove()


def compress_model(model: nn.Module, calib: torch.Tensor, evals: torch.Tensor, job: CompressJob,
                   log=print, before: float | None = None) -> CompressReport:
    """Compress ``model`` in place (see the module docstring); QAT leaves QAT linears in
    the model (their weights are the raw values the export quantizes). ``before``: the
    perplexity of the uncompressed model when the caller knows it."""
    t0 = time.perf_counter()
    targets = linear_targets(model, None, job.exclude)
    before = perplexity(model, evals) if before is None else before
    log(f"perplexity before: {before:.3f}")
    data = _batches(calib, job.batch)
    history: list[tuple[float, float]] = []
    steps = job.steps
    masks: dict[str, torch.Tensor] = {}
    if job.n is not None:
        if job.method == "admm":
            admm_steps = steps // 2
            history = _admm_phase(model, targets, job, admm_steps, data)
            steps -= admm_steps
            masks = magnitude_masks(targets, job.n, job.m)
        elif job.method == "wanda":
            norms = collect_input_norms(model, targets, lambda: perplexity(model, calib))
            masks = wanda_masks(targets, job.n, job.m, norms)
        elif job.method == "magnitude":
            masks = magnitude_masks(targets, job.n, job.m)
        else:
            raise ValueError(f"--method must be admm, magnitude or wanda, got {job.method!r}")
        apply_masks_(model, masks)
    spec = QuantSpec(job.bits, job.group_size) if job.bits else None
    if spec is not None and steps > 0:
        swap_qat(model, targets, spec)  # QAT: the fine-tune sees quantized weights
    if steps > 0:
        model.train()
        _finetune(model, masks, job, steps, data)
        model.eval()
    if spec is not None and steps == 0:
        ptq_(targets, spec)
    after = perplexity(model, evals)
    log(f"perplexity after: {after:.3f}")
    return CompressReport(before, after, time.perf_counter() - t0, list(targets), history)
