"""Engine sizes per device: the KV cache and the batch budgets.

On CPU they are the configuration's values (a 512 MiB cache, 512 tokens and 64 sequences
a pass). On CUDA the values the user did not set follow vLLM: the KV cache takes what
``gpu_memory_utilization`` (0.9) of the GPU's memory leaves once the weights are loaded
and a pass's activations are set aside, a pass holds up to 8192 tokens and 256 sequences.
A value given explicitly (``num_blocks``, ``kv_cache_bytes``, ``max_num_batched_tokens``,
``max_num_seqs``) is always kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zeal.config.inference import EngineConfig

# vLLM's CUDA defaults for max_num_batched_tokens and max_num_seqs (an online server)
CUDA_MAX_NUM_BATCHED_TOKENS = 8192
CUDA_MAX_NUM_SEQS = 256


@dataclass
class EngineSizes:
    num_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int


def activation_reserve(max_num_batched_tokens: int, max_num_seqs: int, hidden: int, intermediate: int,
                       vocab: int, elt: int) -> int:
    """Bytes set aside for one pass's transient tensors: a few hidden-sized and one MLP
    activation per token, fp32 logits and sampling copies per sequence."""
    per_token = (6 * hidden + 2 * intermediate) * elt
    return max_num_batched_tokens * per_token + max_num_seqs * vocab * 4 * 4


def free_kv_bytes(device: torch.device, utilization: float, reserve: int) -> int:
    """KV-cache bytes on a CUDA ``device`` that keep the process under ``utilization`` of
    its memory: ``utilization * total - (in use now) - reserve``."""
    free, total = torch.cuda.mem_get_info(device)
    budget = int(utilization * total) - (total - free) - reserve
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization {utilization} leaves no room for a KV cache on {device}: "
                         f"{(total - free) / 2**30:.1f} GiB of {total / 2**30:.1f} GiB in use and "
                         f"{reserve / 2**30:.2f} GiB set aside for activations; raise it or give kv_cache_bytes")
    return budget


def engine_sizes(cfg: EngineConfig, model, device: torch.device, block_bytes: int) -> EngineSizes:
    """The cache blocks and pass budgets of an engine serving ``model`` on ``device``, each
    block ``block_bytes`` (see the module docstring)."""
    given = cfg.model_fields_set
    cuda = device.type == "cuda" and torch.cuda.is_available()
    tokens = cfg.max_num_batched_tokens
    seqs = cfg.max_num_seqs
    if cuda and "max_num_batched_tokens" not in given:
        tokens = CUDA_MAX_NUM_BATCHED_TOKENS
    if cuda and "max_num_seqs" not in given:
        seqs = CUDA_MAX_NUM_SEQS
    if cfg.num_blocks:
        return EngineSizes(cfg.num_blocks, tokens, seqs)
    if cuda and "kv_cache_bytes" not in given:
        mc = model.config
        hidden = getattr(mc, "hidden_size", None) or getattr(mc, "n_embd", 0)
        inter = getattr(mc, "intermediate_size", None) or 4 * hidden
        elt = next(model.parameters()).element_size()
        reserve = activation_reserve(tokens, seqs, hidden, inter, mc.vocab_size, elt)
        kv = free_kv_bytes(device, cfg.gpu_memory_utilization, reserve)
        return EngineSizes(max(1, kv // block_bytes), tokens, seqs)
    return EngineSizes(max(1, cfg.kv_cache_bytes // block_bytes), tokens, seqs)
