"""Weight-only int8 matmuls for a served compressed-tensors folder.

A folder written by ``zeal compress --format compressed-tensors`` stores each quantized
linear as int codes and scales. By default they are dequantized on load
(:func:`zeal.compression.export.decompress_state`); with ``quantized_matmul="auto"`` the
(bf16 serving) or ``"int8"`` (bf16 and fp32) the linears whose group is int8 per output
channel keep their codes and compute with
PyTorch's CPU kernel ``torch._weight_int8pack_mm(x, codes [out, in], scales [out])``,
which multiplies by the int8 codes and applies the per-channel scale to the result: the
weights stay resident at one byte each instead of two (bf16) or four (fp32). It trades
speed for memory: on this project's 2-core CPU, SmolLM2-135M in bf16 serves at 0.61x the
dequantized folder's tokens/s (oneDNN's packed bf16 GEMM is faster) with 210 MiB resident
instead of 513 MiB; fp32 runs at 0.05x (``bench/compression/bench_serve_compressed.py``).

What the kernel supports, and so where the swap happens (elsewhere: dequantized as before):
CPU, activations fp32 or bf16 (the scales held in the activation dtype), 2-d inputs (the
module flattens the leading dimensions), per-channel scales only (group-wise int8 and int4
folders are dequantized), and in bf16 an input width that is a multiple of 16 (other widths
give wrong results in torch 2.13's bf16 kernel, so they are left to ``F.linear``).

A model with these layers is serve-only: its quantized weights are not parameters, and
``LLM.load_weights`` refuses it (see :func:`has_quantized_linears`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Int8Linear", "QUANTIZED_MATMUL_MODES", "apply_quantized_matmuls", "has_quantized_linears",
           "int8_channel_codes"]

QUANTIZED_MATMUL_MODES = ("off", "auto", "int8")


def _kernel_available() -> bool:
    return hasattr(torch, "_weight_int8pack_mm")


def int8_supported(in_features: int, dtype: torch.dtype, device: torch.device, mode: str = "int8") -> bool:
    """Whether ``torch._weight_int8pack_mm`` computes this layer correctly (see module
    docstring); ``mode="auto"`` also leaves fp32 out (the kernel's fp32 path is ~20x slower
    than oneDNN's fp32 GEMM on SmolLM2's shapes)."""
    if device.type != "cpu" or not _kernel_available():
        return False
    return (dtype == torch.float32 and mode == "int8") or (dtype == torch.bfloat16 and in_features % 16 == 0)


class Int8Linear(nn.Module):
    """A linear layer computing with int8 weight codes and per-output-channel scales:
    ``y = (x @ codes.T) * scales + bias``, equal to ``F.linear(x, codes * scales, bias)``
    up to the order of rounding (the scale applied after the sum instead of to each weight)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        super().__init__()
        if codes.dtype != torch.int8 or codes.dim() != 2:
            raise ValueError(f"Int8Linear: codes must be a 2-d int8 tensor, got {codes.dtype} {tuple(codes.shape)}")
        if scales.numel() != codes.shape[0]:
            raise ValueError(f"Int8Linear: {scales.numel()} scales for {codes.shape[0]} output channels "
                             "(per-channel scales only)")
        self.out_features, self.in_features = codes.shape
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales", scales.reshape(-1).to(dtype).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != self.scales.dtype:
            y = F.linear(x2, self.dequantized().to(x2.dtype))
        else:
            y = torch._weight_int8pack_mm(x2.contiguous(), self.codes, self.scales)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight ``codes * scales`` in fp32."""
        return self.codes.float() * self.scales.float().unsqueeze(1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def int8_channel_codes(folder: str | Path, cfg: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The int8 codes ``[out, in]`` and fp32 scales ``[out]`` of every linear of a
    compressed-tensors ``folder`` whose config group is 8-bit per channel (the others:
    none here, they are dequantized)."""
    from zeal.compression.export import _bits_of, _ct
    from zeal.models.hf import read_safetensors_folder

    qc = cfg.get("quantization_config") or {}
    if qc.get("quant_method") != "compressed-tensors" or qc.get("format") != "pack-quantized":
        return {}
    targets, channel = [], set()
    for group in (qc.get("config_groups") or {}).values():
        w = group.get("weights") or {}
        for t in group.get("targets", []):
            targets.append((t, int(w.get("num_bits", 0))))
            if w.get("strategy") == "channel" and int(w.get("num_bits", 0)) == 8:
                channel.add(t)
    _, unpack_from_int32 = _ct()
    raw = read_safetensors_folder(folder)
    out = {}
    for key in [k for k in raw if k.endswith(".weight_packed")]:
        layer = key.removesuffix(".weight_packed")
        if _bits_of(layer, targets) != 8 or not _in_channel_group(layer, targets, channel):
            continue
        scale = raw[f"{layer}.weight_scale"]
        shape = torch.Size(raw[f"{layer}.weight_shape"].tolist())
        if scale.dim() != 2 or scale.shape[1] != 1:
            continue
        q = unpack_from_int32(raw[key], 8, shape).to(torch.int8)
        out[layer] = (q, scale.float().reshape(-1))
    return out


def _in_channel_group(layer: str, targets: list[tuple[str, int]], channel: set[str]) -> bool:
    """Whether the group ``layer`` falls in (by the rule of ``_bits_of``) is per-channel."""
    import re

    for match in (lambda t: t == layer, lambda t: t.startswith("re:") and re.match(t[3:], layer) is not None,
                  lambda t: t == "Linear"):
        for t, _ in targets:
            if match(t):
                return t in channel
    return False


def apply_quantized_matmuls(model: nn.Module, folder: str | Path, cfg: dict | None = None,
                            mode: str = "auto") -> int:
    """Swap each plain ``nn.Linear`` of ``model`` (loaded from the compressed-tensors
    ``folder``) that is int8 per channel there, and that the kernel supports, for an
    :class:`Int8Linear`. Returns how many were swapped (0 for a dense folder)."""
    cfg = cfg if cfg is not None else json.loads((Path(folder) / "config.json").read_text())
    codes = int8_channel_codes(folder, cfg)
    n = 0
    for layer, (q, scale) in codes.items():
        parent_name, _, child = layer.rpartition(".")
        try:
            lin = model.get_submodule(layer)
        except AttributeError:
            continue
        if type(lin) is not nn.Linear or tuple(lin.weight.shape) != tuple(q.shape):
            continue
        w = lin.weight
        if not int8_supported(lin.in_features, w.dtype, w.device, mode):
            continue
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int8Linear(q.to(w.device), scale.to(w.device), lin.bias, w.dtype))
        n += 1
    return n


def has_quantized_linears(model: nn.Module) -> bool:
    """Whether ``model`` computes with :class:`Int8Linear` layers (serve-only)."""
    return any(isinstance(m, Int8Linear) for m in model.modules())
