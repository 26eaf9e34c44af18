"""Weight-only int8 / int4 storage of streamed decoder layers (ZeRO-Inference).

Every 2-d weight of a decoder layer (the linear projections) is stored as symmetric
group-wise codes with one bf16 scale per group of consecutive input weights, quantized by
:func:`zeal.compression.quant.quantize` (the quantizer of the compression work); the
other tensors (norms, biases) stay in the serving dtype. int4 codes are packed two to a
byte: byte ``j`` holds code ``j`` (low nibble) and code ``j + h`` (high nibble), ``h`` =
half the codes rounded up, so unpacking writes two contiguous halves. A layer's bytes on disk are then about a half (int8) or a
quarter (int4) of its bf16 bytes, and so are the bytes read per pass; on arrival the codes
are dequantized (``q · scale`` in fp32, then cast) into the layer's resident slot, so the
model computes exactly as the resident model whose weights went through
:func:`quantize_dequantize_weight`.

Groups hold :data:`GROUP_SIZE` input weights; a row whose length it does not divide takes
the largest power of two below it that does (SmolLM2's 576-wide rows: groups of 64), and
a row with no such divisor of at least 8 is one group.
"""

from __future__ import annotations

import torch

from zeal.compression.quant import dequantize, quantize

QUANT_KINDS = ("none", "int8", "int4")
GROUP_SIZE = 128
SCALE_DTYPE = torch.bfloat16


def check_quant(kind: str) -> int:
    """The bits of ``kind`` (0 for ``none``); ValueError naming the accepted values otherwise."""
    if kind not in QUANT_KINDS:
        raise ValueError(f"weights_offload_quant must be one of {', '.join(QUANT_KINDS)}, got {kind!r}")
    return {"none": 0, "int8": 8, "int4": 4}[kind]


def group_size_for(row: int) -> int:
    """Input weights per scale for rows of length ``row`` (see the module docstring)."""
    g = GROUP_SIZE
    while g >= 8 and row % g:
        g //= 2
    return g if g >= 8 else row


def is_quantized(t: torch.Tensor) -> bool:
    """Which tensors of a layer are stored as codes: the 2-d weights."""
    return t.dim() == 2


def code_bytes(numel: int, bits: int) -> int:
    """Bytes of ``numel`` packed codes."""
    return -(-numel * bits // 8)


def encode(w: torch.Tensor, bits: int) -> tuple[bytes, bytes, int]:
    """``(packed codes, bf16 scales [out, groups], group size)`` of a 2-d weight ``w``."""
    group = group_size_for(w.shape[1])
    q, scale = quantize(w, bits, group, scale_dtype=SCALE_DTYPE)
    flat = q.reshape(-1)
    if bits == 4:
        if flat.numel() % 2:
            flat = torch.cat([flat, flat.new_zeros(1)])
        nib = (flat.to(torch.int16) & 0xF).view(2, -1)
        flat = (nib[0] | (nib[1] << 4)).to(torch.uint8)
    return flat.view(torch.uint8).numpy().tobytes(), scale.contiguous().view(torch.uint8).numpy().tobytes(), group


def unpack_codes(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """int8 codes from the uint8 ``packed`` bytes (two per byte for int4)."""
    if bits == 8:
        return packed[:numel].view(torch.int8)
    codes = torch.empty(numel, dtype=torch.int8)
    _codes_into(codes, packed, bits)
    return codes


def _codes_into(flat: torch.Tensor, packed: torch.Tensor, bits: int) -> None:
    """The codes of ``packed``, converted, into the 1-d ``flat`` (exact: |code| <= 128)."""
    n = flat.numel()
    if bits == 8:
        flat.copy_(packed[:n].view(torch.int8))
        return
    b = packed.view(torch.int8)  # arithmetic shifts sign-extend each nibble
    h = b.numel()
    flat[:h].copy_((b << 4) >> 4)
    flat[h:].copy_((b >> 4)[: n - h])


def decode_into(out: torch.Tensor, packed: torch.Tensor, scale_bytes: torch.Tensor, bits: int,
                scratch: torch.Tensor | None = None) -> None:
    """Dequantize codes and bf16 scales (uint8 views) into the 2-d ``out`` (its dtype):
    the values of :func:`zeal.compression.quant.dequantize`, ``q · scale`` in fp32 rounded
    once. In fp32 and bf16 the codes are converted into ``out`` and multiplied in place:
    a code (8 significant bits at most) times a bf16 scale (8) is exact in fp32, so bf16's
    multiply (fp32, rounded once) gives the same bits. Other dtypes go through the fp32
    ``scratch`` (at least one row), rows at a time."""
    rows, cols = out.shape
    scale = scale_bytes.view(SCALE_DTYPE).view(rows, -1)
    groups = scale.shape[1]
    if out.dtype in (torch.float32, torch.bfloat16):
        _codes_into(out.view(-1), packed, bits)
        out.view(rows, groups, cols // groups).mul_(scale.to(out.dtype).unsqueeze(-1))
        return
    q = unpack_codes(packed, bits, out.numel()).view(out.shape)
    if scratch is None:
        dequantize(q, scale, out=out)
        return
    step = max(1, scratch.numel() // cols)
    for r in range(0, rows, step):
        part = scratch[: min(step, rows - r) * cols].view(-1, cols)
        out[r: r + step].copy_(dequantize(q[r: r + step], scale[r: r + step], out=part))


def quantize_dequantize_weight(w: torch.Tensor, bits: int) -> torch.Tensor:
    """The value a stored 2-d weight stands for once dequantized, in ``w``'s dtype: what
    a resident reference model holds to compute exactly as the streamed one."""
    q, scale = quantize(w, bits, group_size_for(w.shape[1]), scale_dtype=SCALE_DTYPE)
    return dequantize(q, scale, w.dtype)
