"""Compression applied to a plain model: which linears, masks, QAT modules, PTQ.

Targets are the ``nn.Linear`` layers whose qualified name matches one of ``modules``
(``fnmatch`` patterns, default every linear) and none of ``exclude`` (default the output
head, ``lm_head``, often tied to the embedding). Their weights are ``[out, in]``: N:M
groups and quantization groups run along ``in``.

:class:`QATLinear` is an ``nn.Linear`` sharing the original's ``weight`` and ``bias``
Parameters (same names, so checkpoints, ZeRO and exports see the same model) whose
forward fake-quantizes the weight (per channel or per group) and, optionally, its input
activation (per tensor).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zeal.compression.nm import nm_mask
from zeal.compression.quant import fake_quant, fake_quant_activation, quantize_dequantize

__all__ = ["QATLinear", "QuantSpec", "apply_masks_", "collect_input_norms", "feed_inputs", "linear_targets", "magnitude_masks",
           "ptq_", "swap_qat", "wanda_masks"]


@dataclass(frozen=True)
class QuantSpec:
    """Weight bits (8 or 4), weight group size (None: one scale per output channel) and
    activation bits (None: activations stay in floating point)."""

    bits: int = 8
    group_size: int | None = None
    act_bits: int | None = None


class QATLinear(nn.Linear):
    """A linear layer with fake-quantized weight (and input), straight-through gradients."""

    def __init__(self, base: nn.Linear, spec: QuantSpec) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias  # the same Parameters
        self.spec = spec
        self.active = True  # False: a plain linear (QAT not begun yet)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return F.linear(x, self.weight, self.bias)
        if self.spec.act_bits is not None:
            x = fake_quant_activation(x, self.spec.act_bits)
        return F.linear(x, fake_quant(self.weight, self.spec.bits, self.spec.group_size), self.bias)


def linear_targets(model: nn.Module, modules: Iterable[str] | None = None,
                   exclude: Iterable[str] = ("lm_head", "*.lm_head")) -> dict[str, nn.Linear]:
    """The linears to compress, by qualified module name, in module order."""
    inc, exc = list(modules or ["*"]), list(exclude)
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)
            and any(fnmatch.fnmatchcase(n, p) for p in inc) and not any(fnmatch.fnmatchcase(n, p) for p in exc)}


def swap_qat(model: nn.Module, names: Iterable[str], spec: QuantSpec) -> None:
    """Replace each named linear by a :class:`QATLinear` over the same Parameters."""
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = getattr(parent, child)
        if not isinstance(base, QATLinear):
            setattr(parent, child, QATLinear(base, spec))


def magnitude_masks(targets: dict[str, nn.Linear], n: int, m: int) -> dict[str, torch.Tensor]:
    """One-shot magnitude N:M masks (by weight parameter name ``<module>.weight``)."""
    return {f"{k}.weight": nm_mask(lin.weight.detach().abs(), n, m) for k, lin in targets.items()}


def wanda_masks(targets: dict[str, nn.Linear], n: int, m: int, norms: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Wanda: N:M masks of ``|W_ij|·‖X_j‖``, ``‖X_j‖`` the norm of input feature j over the
    calibration tokens (:func:`collect_input_norms`)."""
    return {f"{k}.weight": nm_mask(lin.weight.detach().abs().float() * norms[k].float().unsqueeze(0), n, m)
            for k, lin in targets.items()}


@torch.no_grad()
def feed_inputs(targets: dict[str, nn.Linear], run: Callable[[], None],
                consume: Callable[[str, torch.Tensor], None]) -> None:
    """Call ``consume(name, x)`` with every target linear's input, flattened to ``[tokens,
    in]`` and detached, while ``run()`` feeds the calibration data through the model."""

    def hook(name: str):
        def fn(_mod: nn.Module, args: tuple) -> None:
            consume(name, args[0].detach().reshape(-1, args[0].shape[-1]))
        return fn

    handles = [lin.register_forward_pre_hook(hook(k)) for k, lin in targets.items()]
    try:
        run()
    finally:
        for h in handles:
            h.remove()


def collect_input_norms(model: nn.Module, targets: dict[str, nn.Linear],
                        run: Callable[[], None]) -> dict[str, torch.Tensor]:
    """``‖X_j‖₂`` per input feature of every target linear while ``run()`` feeds the
    calibration data through ``model``."""
    sums = {k: torch.zeros(lin.in_features, dtype=torch.float64) for k, lin in targets.items()}
    feed_inputs(targets, run, lambda name, x: sums[name].add_(x.double().pow(2).sum(0)))
    return {k: v.sqrt().float() for k, v in sums.items()}


@torch.no_grad()
def apply_masks_(model: nn.Module, masks: dict[str, torch.Tensor]) -> None:
    """Zero the masked-out weights (masks by parameter name)."""
    params = dict(model.named_parameters())
    for name, mask in masks.items():
        params[name].mul_(mask.to(params[name].dtype))


@torch.no_grad()
def ptq_(targets: dict[str, nn.Linear], spec: QuantSpec) -> None:
    """Post-training quantization: every target weight replaced by its quantized value."""
    for lin in targets.values():
        lin.weight.copy_(quantize_dequantize(lin.weight, spec.bits, spec.group_size))
