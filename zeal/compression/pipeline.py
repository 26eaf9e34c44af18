"""One-process compression of a model (what ``zeal compress`` runs).

1. prune to N:M: one-shot ``magnitude`` or ``wanda`` (activation norms from the
   calibration blocks), or ``admm``: with ``admm_objective="reconstruction"`` (default)
   ADMM on every linear's output error over the calibration blocks
   (:mod:`zeal.compression.admm_layerwise`; no optimizer steps), with ``"loss"``
   NxMTransformer's ADMM on the training loss (the first ``admm_fraction`` of the step
   budget runs ADMM with AdamW, then the weights are projected);
2. fine-tune the remaining steps with the masks held (masked weights and their AdamW
   moments reset after every step) and, with ``bits``, quantization-aware (QAT);
   with no steps left, ``bits`` is post-training quantization through the same quantizer;
3. perplexity on the held-out blocks before and after.

Every method gets the same number of optimizer steps on the same fine-tuning blocks
(``train``; the calibration blocks when not given) with the same loss: next-token
cross-entropy (``loss="ce"``) or distillation from the uncompressed model (``loss="kd"``:
``KL(p_dense ‖ p_student)`` per token, the dense model a frozen copy taken first).

The training-loss ADMM's options (see :mod:`zeal.compression.admm`): ``admm_penalty="prox"`` applies the
penalty as its proximal step after every AdamW step (``"grad"``: through the gradient,
which Adam normalises); ``admm_metric="activation"`` weights the penalty and the
projection by ``‖X_j‖²`` per input column, scaled so that its least column is 1 (the
projection is then Wanda's score),
``"euclidean"`` is NxMTransformer's plain projection. ``ρ`` grows geometrically from
``rho`` to ``rho_max`` over the Z-steps of the ADMM phase, so the weights reach the N:M
set before the hard prune; the residuals (primal relative to ``‖W‖``) are logged.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from zeal.compression.admm import ADMM, ADMMResiduals, RhoSchedule
from zeal.compression.admm_layerwise import reconstruction_admm
from zeal.compression.calibration import model_logits, perplexity
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
from zeal.compression.nm import nm_mask

__all__ = ["CompressJob", "CompressReport", "compress_model"]


@dataclass(frozen=True)
class CompressJob:
    """What to do (the ``zeal compress`` flags, and the bench's options)."""

    n: int | None = 2  # None: no sparsity
    m: int = 4
    method: str = "magnitude"  # magnitude | wanda | admm
    bits: int | None = None
    group_size: int | None = None
    steps: int = 0
    lr: float = 1e-5
    batch: int = 2
    loss: str = "ce"  # ce | kd
    admm_interval: int = 1
    admm_fraction: float = 0.25
    admm_penalty: str = "prox"  # prox | grad
    admm_metric: str = "activation"  # activation | euclidean
    admm_objective: str = "reconstruction"  # reconstruction | loss
    admm_iters: int = 20  # reconstruction: ADMM iterations per linear (60 in bench/compression: ~3x the time)
    rho: float = 0.3  # the best measured on SmolLM2 (bench/compression/README.md)
    rho_max: float = 10.0
    exclude: tuple[str, ...] = ("lm_head", "*.lm_head")


@dataclass
class CompressReport:
    ppl_before: float
    ppl_after: float
    seconds: float
    targets: list[str] = field(default_factory=list)
    admm_residuals: list[ADMMResiduals] = field(default_factory=list)


def distill_loss(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of ``KL(softmax(teacher) ‖ softmax(student))`` (logits ``[..., V]``)."""
    s = F.log_softmax(student.float().reshape(-1, student.shape[-1]), -1)
    t = F.log_softmax(teacher.float().reshape(-1, teacher.shape[-1]), -1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean")


def _loss_fn(job: CompressJob, teacher: nn.Module | None):
    if job.loss == "ce":
        return lambda model, x: model(x, labels=x)

    def kd(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            t = model_logits(teacher, x)
        return distill_loss(model_logits(model, x), t)
    return kd


def _batches(calib: torch.Tensor, batch: int):
    i = 0
    while True:
        yield calib[(torch.arange(batch) + i) % calib.shape[0]]
        i += batch


def _mask_fn(job: CompressJob, norms: dict[str, torch.Tensor] | None):
    """``(key, weight) -> bool mask``: the N:M projection's support (in the activation
    metric when ``norms`` are given: Wanda's score)."""
    if norms is None:
        return lambda _k, v: nm_mask(v.abs(), job.n, job.m)
    cols = {f"{k}.weight": v.float().unsqueeze(0) for k, v in norms.items()}
    return lambda k, v: nm_mask(v.abs() * cols[k], job.n, job.m)


def _admm_phase(model: nn.Module, targets: dict, job: CompressJob, steps: int, data, loss_fn, mask_fn,
                norms: dict[str, torch.Tensor] | None, log) -> list[ADMMResiduals]:
    weights = {f"{k}.weight": lin.weight for k, lin in targets.items()}
    metric = {}
    if norms is not None:
        for k in targets:
            d = norms[k].float().pow(2)  # scaled so that its least column is 1: no weight pulled less than by rho
            metric[f"{k}.weight"] = (d / d.min().clamp_min(1e-6 * float(d.mean()) + 1e-30)).unsqueeze(0)
    zsteps = max(1, math.ceil(steps / job.admm_interval))
    growth = (job.rho_max / job.rho) ** (1 / max(1, zsteps - 1))
    admm = ADMM(weights, lambda k, v: v * mask_fn(k, v), RhoSchedule(job.rho, growth, job.rho_max), metric=metric)
    opt = torch.optim.AdamW(model.parameters(), lr=job.lr, weight_decay=0.0)
    history = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss_fn(model, next(data)).backward()
        if job.admm_penalty == "grad":
            admm.add_penalty_grad_()
        opt.step()
        if job.admm_penalty == "prox":
            admm.prox_()
        if (step + 1) % job.admm_interval == 0 or step + 1 == steps:
            r = admm.update()
            history.append(r)
            log(f"admm step {step + 1}: primal {r.primal:.3e} ({r.primal_rel:.2%} of |W|) dual {r.dual:.3e} "
                f"rho {r.rho:.3g}")
    return history


def _finetune(model: nn.Module, masks: dict[str, torch.Tensor], job: CompressJob, steps: int, data, loss_fn) -> None:
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=job.lr, weight_decay=0.0)
    enforcer = MaskEnforcer(opt, [params[k] for k in masks], list(masks.values())) if masks else None
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss_fn(model, next(data)).backward()
        opt.step()
    if enforcer is not None:
        enforcer.remove()


def _check_job(job: CompressJob) -> None:
    for name, value, allowed in (("method", job.method, ("admm", "magnitude", "wanda")), ("loss", job.loss, ("ce", "kd")),
                                 ("admm_penalty", job.admm_penalty, ("prox", "grad")),
                                 ("admm_metric", job.admm_metric, ("activation", "euclidean")),
                                 ("admm_objective", job.admm_objective, ("reconstruction", "loss"))):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    if not 0 < job.admm_fraction < 1 or not 0 < job.rho <= job.rho_max or job.admm_interval < 1:
        raise ValueError("ADMM needs 0 < admm_fraction < 1, 0 < rho <= rho_max and admm_interval >= 1, got "
                         f"{job.admm_fraction}, {job.rho}, {job.rho_max}, {job.admm_interval}")


def _prune(model, targets, job, calib, steps, data, loss_fn, log):
    """Step 1: the masks (and, for ADMM, the steps it used and its residuals)."""
    if job.method == "admm" and job.admm_objective == "reconstruction":
        masks, history = reconstruction_admm(targets, lambda: perplexity(model, calib), job.n, job.m,
                                             iters=job.admm_iters, model=model, log=log)
        return masks, 0, history
    norms = None
    if job.method == "wanda" or (job.method == "admm" and job.admm_metric == "activation"):
        norms = collect_input_norms(model, targets, lambda: perplexity(model, calib))
    if job.method == "magnitude":
        return magnitude_masks(targets, job.n, job.m), 0, []
    if job.method == "wanda":
        return wanda_masks(targets, job.n, job.m, norms), 0, []
    admm_steps = int(steps * job.admm_fraction)
    mask_fn = _mask_fn(job, norms)
    model.train()
    history = _admm_phase(model, targets, job, admm_steps, data, loss_fn, mask_fn, norms, log)
    model.eval()
    return {f"{k}.weight": mask_fn(f"{k}.weight", lin.weight.detach().float()) for k, lin in targets.items()}, \
        admm_steps, history


def compress_model(model: nn.Module, calib: torch.Tensor, evals: torch.Tensor, job: CompressJob,
                   log=print, before: float | None = None, train: torch.Tensor | None = None) -> CompressReport:
    """Compress ``model`` in place (see the module docstring); QAT leaves QAT linears in
    the model (their weights are the raw values the export quantizes). ``before``: the
    perplexity of the uncompressed model when the caller knows it; ``train``: the
    fine-tuning blocks (default ``calib``)."""
    _check_job(job)
    t0 = time.perf_counter()
    targets = linear_targets(model, None, job.exclude)
    before = perplexity(model, evals) if before is None else before
    log(f"perplexity before: {before:.3f}")
    data = _batches(calib if train is None else train, job.batch)
    teacher = None
    if job.loss == "kd" and job.steps > 0:
        teacher = copy.deepcopy(model).eval().requires_grad_(False)
    loss_fn = _loss_fn(job, teacher)
    history: list[ADMMResiduals] = []
    steps = job.steps
    masks: dict[str, torch.Tensor] = {}
    if job.n is not None:
        masks, used, history = _prune(model, targets, job, calib, steps, data, loss_fn, log)
        steps -= used
        apply_masks_(model, masks)
    spec = QuantSpec(job.bits, job.group_size) if job.bits else None
    if spec is not None and steps > 0:
        swap_qat(model, targets, spec)  # QAT: the fine-tune sees quantized weights
    if steps > 0:
        model.train()
        _finetune(model, masks, job, steps, data, loss_fn)
        model.eval()
    if spec is not None and steps == 0:
        ptq_(targets, spec)
    after = perplexity(model, evals)
    log(f"perplexity after: {after:.3f}")
    return CompressReport(before, after, time.perf_counter() - t0, list(targets), history)
