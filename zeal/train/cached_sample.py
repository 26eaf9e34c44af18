"""The final sample of a job on zeal's Llama (the default job's SmolLM2), one token per forward.

:func:`zeal.train.job.sample` pads every forward to the full block so each has one shape;
on a 135M-parameter model that is a 128-token forward per new token, and under ZeRO-3 a
gather of every weight per token. Here the weights are gathered once for the whole sample
(``engine.gathered_parameters()``), the prompt is run once, and each new token is one
single-token forward that attends to the keys and values kept by :class:`KVCacheAttention`.
The tokens are those of a plain loop over the growing context (up to kernel rounding).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from zeal.models.attention import dense_causal_attention
from zeal.models.gpt import sample_next


class KVCacheAttention:
    """Causal attention that appends each layer's new keys and values to those of the
    earlier forwards of the same sequence (batch dimension first, see
    :class:`zeal.models.attention.Attention`)."""

    ops = None  # torch ops only (the fused serving kernels are for the paged cache)

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 dropout_p: float = 0.0) -> torch.Tensor:
        if layer_idx in self.k:
            k = torch.cat([self.k[layer_idx], k], dim=-3)
            v = torch.cat([self.v[layer_idx], v], dim=-3)
        self.k[layer_idx], self.v[layer_idx] = k, v
        new, total = q.shape[-3], k.shape[-3]
        if new == total:  # the prompt: plain causal attention
            return dense_causal_attention(q, k, v)
        rep = q.shape[-2] // k.shape[-2]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=-2), v.repeat_interleave(rep, dim=-2)
        # query i sits at position total - new + i and sees keys 0..that position
        mask = torch.ones(new, total, dtype=torch.bool, device=q.device).tril(total - new)
        y = F.scaled_dot_product_attention(q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2),
                                           attn_mask=mask)
        return y.transpose(-3, -2)


@torch.no_grad()
def cached_sample(engine: Any, tokenizer: Any, prompt: str, max_new_tokens: int, temperature: float, top_k: int,
                  seed: int) -> str:
    """``prompt`` continued by ``max_new_tokens`` tokens, on every rank in lockstep: rank 0
    draws each token and broadcasts it. ``engine.module`` is a :class:`zeal.models.llama.Llama`."""
    engine.eval()
    ids = torch.tensor([tokenizer.encode(prompt).ids or [0]], dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    cache = KVCacheAttention()
    step = ids
    try:
        with engine.gathered_parameters():
            for _ in range(max_new_tokens):
                start = ids.shape[1] - step.shape[1]
                logits = engine({"input_ids": step, "positions": torch.arange(start, ids.shape[1]),
                                 "attention": cache, "logits_index": torch.tensor([step.shape[1] - 1])})
                nxt = sample_next(logits[:, -1], temperature, top_k, gen)
                engine.mesh.world.broadcast(nxt, 0, "control")
                ids = torch.cat([ids, nxt], dim=1)
                step = nxt
    finally:
        engine.train()
    return tokenizer.decode(ids[0].tolist())
