"""FLOPs of a training step and the device's peak: what ``tflops`` and ``mfu`` are computed from.

A step's model FLOPs follow the usual count (Kaplan et al.; PaLM's appendix): each weight of
a matrix multiply costs 2 FLOPs per token forward and 4 backward, ``6·N`` per token for the
``N`` weights of the model's linear layers (the LM head included, embedding look-ups not),
plus attention's two matmuls, ``12·L·d·s`` per token for ``L`` layers of width ``d`` over
``s`` tokens of context (counted whole, as DeepSpeed's profiler and torch's FLOP counter do).
Recomputation under activation checkpointing is not model FLOPs (MFU, not HFU).
"""

from __future__ import annotations

import functools
import time

import torch
from torch import nn

# dense bf16/fp16 tensor-core peaks in TFLOP/s (vendor datasheets, without sparsity)
GPU_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10G": 125.0,
                   "A10": 125.0, "V100": 125.0, "T4": 65.0, "4090": 165.0, "3090": 71.0}


def matmul_weights(model: nn.Module) -> int:
    """Weights of the model's linear layers, each module counted once per use of its weight
    (a head tied to the embedding is a matmul of its own)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def attention_shape(model: nn.Module) -> tuple[int, int]:
    """``(layers, width)`` of the model's attention, from a zeal or Hugging Face config."""
    cfg = getattr(model, "config", None) or getattr(model, "cfg", None)
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None) or 0
    width = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None) or 0
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    head_dim = getattr(cfg, "head_dim", None)
    if heads and head_dim:  # attention width may differ from the hidden size
        width = heads * head_dim
    return int(layers), int(width)


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Model FLOPs of one token's forward and backward at context ``seq_len``."""
    layers, width = attention_shape(model)
    return 6.0 * matmul_weights(model) + 12.0 * layers * width * seq_len


@functools.lru_cache(maxsize=8)
def peak_flops(device_type: str, index: int = 0) -> tuple[float, str]:
    """The device's peak FLOP/s and where the figure comes from: the datasheet's dense
    bf16 peak for a known GPU; on a CPU (or an unknown GPU) a measured fp32 matmul rate."""
    if device_type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(index)
        for key, tflops in GPU_PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12, f"{name} datasheet (dense bf16)"
    n, reps = 512, 8
    a = torch.full((n, n), 0.5)  # no draw from the global RNG: measuring must not change a run's randomness
    a @ a
    t = time.perf_counter()
    for _ in range(reps):
        a @ a
    rate = reps * 2 * n**3 / (time.perf_counter() - t)
    return rate, f"measured fp32 {n}x{n} matmul rate on {device_type} (no datasheet peak)"
