"""Symmetric fake quantization with straight-through gradients (QAT) and its PTQ twin.

A weight ``w`` of shape ``[out, in]`` is quantized with one scale per output channel
(``group_size=None``) or per group of ``group_size`` consecutive input weights:
``s = amax(|w|)/qmax`` over the channel or group, ``q = clamp(round(w/s), −qmax−1, qmax)``
with ``qmax = 2**(bits−1) − 1``, and ``w ≈ q·s``. The quantizer is symmetric, so
``0 → 0``: a zero of an N:M mask stays exactly zero. Per-channel (or per-group) scales
are used because a per-tensor scale is set by the largest outlier of the whole matrix.
Activations are quantized per tensor (one scale per forward, from the batch's amax).

Straight-through estimator: the forward returns the quantized value, the backward
passes the incoming gradient unchanged (``w + (Q(w) − w).detach()``): since the scale
comes from the amax, no weight lies outside the clamp range, so the clipping variant
would change nothing.
"""

from __future__ import annotations

import torch

__all__ = ["qmax", "quantize", "dequantize", "fake_quant", "fake_quant_activation", "quantize_dequantize"]


def qmax(bits: int) -> int:
    """Largest code of a signed ``bits``-bit integer."""
    if not 2 <= bits <= 8:
        raise ValueError(f"quantization bits must be between 2 and 8, got {bits}")
    return 2 ** (bits - 1) - 1


def _grouped(w: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """``w`` [out, in] as [out, groups, g] (one group of ``in`` per channel when None)."""
    if w.dim() != 2:
        raise ValueError(f"weight quantization expects a 2-d weight, got shape {tuple(w.shape)}")
    g = w.shape[1] if group_size is None else group_size
    if w.shape[1] % g:
        raise ValueError(f"input dimension {w.shape[1]} is not a multiple of the quantization group size {g}")
    return w.reshape(w.shape[0], w.shape[1] // g, g)


def quantize(w: torch.Tensor, bits: int, group_size: int | None = None,
             scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: int8 codes of ``w``'s shape and scales ``[out, groups]`` in
    ``scale_dtype`` (the codes are rounded against the scale as stored, e.g. bf16)."""
    top = qmax(bits)
    g = _grouped(w.detach().float(), group_size)
    scale = (g.abs().amax(-1) / top).to(scale_dtype).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group
    q = torch.clamp(torch.round(g / scale.unsqueeze(-1)), -top - 1, top)
    return q.to(torch.int8).reshape(w.shape), scale.to(scale_dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """``q·scale`` (groups read from the scale's shape), in ``dtype``; with ``out`` (a
    contiguous tensor of ``q``'s shape), written into it in its dtype without temporaries
    (the same values: the product is taken in fp32 and rounded once on the write)."""
    groups = scale.shape[1]
    if out is not None:
        grouped = out.view(q.shape[0], groups, q.shape[1] // groups)
        return torch.mul(q.view(grouped.shape), scale.float().unsqueeze(-1), out=grouped).view(q.shape)
    g = q.float().reshape(q.shape[0], groups, q.shape[1] // groups)
    return (g * scale.float().unsqueeze(-1)).reshape(q.shape).to(dtype)


def quantize_dequantize(w: torch.Tensor, bits: int, group_size: int | None = None) -> torch.Tensor:
    """The value the quantized weight stands for, in ``w``'s dtype (no gradient)."""
    q, s = quantize(w, bits, group_size)
    return dequantize(q, s, w.dtype)


def fake_quant(w: torch.Tensor, bits: int, group_size: int | None = None) -> torch.Tensor:
    """Quantized value forward, identity gradient backward (straight-through)."""
    return w + (quantize_dequantize(w, bits, group_size) - w).detach()


def fake_quant_activation(x: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """Per-tensor symmetric fake quantization of an activation (dynamic scale), STE."""
    top = qmax(bits)
    with torch.no_grad():
        amax = x.detach().abs().amax().float()
        scale = amax / top if amax > 0 else torch.ones(())
        qx = (torch.clamp(torch.round(x.detach().float() / scale), -top - 1, top) * scale).to(x.dtype)
    return x + (qx - x).detach()
