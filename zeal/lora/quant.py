"""Block quantization of frozen base weights for QLoRA: int8 and int4, symmetric, one
scale per block of ``block`` consecutive inputs of a row.

A weight ``W (out, in)`` is cut into blocks ``W[o, j*block:(j+1)*block]``; each block
keeps ``scale = max|w| / qmax`` (fp32) and codes ``round(w / scale)`` in
``[-qmax, qmax]`` (``qmax`` 127 for int8, 7 for int4). int4 codes are stored two per
byte (``(out, in/2)`` uint8, low nibble first, offset by 8). Dequantization is
``codes * scale``: exact integers times one scale, so ``dequantize(quantize(W))`` is
the base the adapters train against, and a LoRA model given that base computes the
same numbers as the quantized one.

Why not NF4: its 16 levels are normal quantiles, which fit normally distributed
weights better at equal bits, but dequantizing needs a table lookup per weight; on CPU
the gather costs about as much as the matmul it feeds, and int4 with small blocks
(64) gets most of the accuracy back. int4/int8 here are pure tensor ops on any device.
"""

from __future__ import annotations

import torch

__all__ = ["QMAX", "dequantize", "quantize", "quantized_bytes"]

QMAX = {"int8": 127, "int4": 7}


def quantize(w: torch.Tensor, kind: str, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of ``w (out, in)``; ``in`` must be a multiple of ``block``."""
    if kind not in QMAX:
        raise ValueError(f"quantization {kind!r} is not supported (int8, int4)")
    out, inp = w.shape
    if inp % block:
        raise ValueError(f"quant_block_size {block} does not divide the {inp} inputs of a weight {tuple(w.shape)}")
    qmax = QMAX[kind]
    blocks = w.detach().float().reshape(out, inp // block, block)
    scale = blocks.abs().amax(-1) / qmax  # (out, in/block)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block: codes 0
    codes = torch.round(blocks / scale[..., None]).clamp_(-qmax, qmax).to(torch.int8).reshape(out, inp)
    if kind == "int4":
        if inp % 2:
            raise ValueError(f"int4 needs an even number of inputs, got {inp}")
        u = (codes + 8).to(torch.uint8)
        codes = u[:, 0::2] | (u[:, 1::2] << 4)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """``W (out, in)`` in ``dtype`` from :func:`quantize`'s output (computed in fp32)."""
    if kind == "int4":
        lo = (codes & 0x0F).to(torch.int8) - 8
        hi = (codes >> 4).to(torch.int8) - 8
        codes = torch.stack((lo, hi), dim=-1).reshape(codes.shape[0], -1)
    out, inp = codes.shape
    nb = scale.shape[-1]
    w = codes.reshape(out, nb, inp // nb).float() * scale.float()[..., None]
    return w.reshape(out, inp).to(dtype)


def quantized_bytes(out: int, inp: int, kind: str, block: int) -> int:
    """Bytes held for a quantized ``(out, in)`` weight: codes plus fp32 scales."""
    codes = out * inp if kind == "int8" else out * inp // 2
    return codes + 4 * out * (inp // block)
