"""Serving forward for zeal's GPT (GPT-2 architecture) over a flat token batch.

:class:`PagedGPT` wraps a :class:`zeal.models.GPT` *without copying its weights*:
the serving engine can generate from a model that is being trained and see
each optimizer step at once (RLHF), or receive new weights through
``ModelRunner.load_weights``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zeal.models.gpt import GPT
from zeal.models.llama import AttnFn, dense_causal_attention


class PagedGPT(nn.Module):
    """``forward(input_ids (T,), positions (T,), attn, logits_index)`` like :class:`zeal.models.llama.Llama`."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.gpt = gpt
        self.config = gpt.config

    @property
    def num_kv_heads(self) -> int:
        return self.config.n_head

    @property
    def head_dim(self) -> int:
        return self.config.n_embd // self.config.n_head

    @property
    def num_layers(self) -> int:
        return self.config.n_layer

    @property
    def max_positions(self) -> int:
        return self.config.n_positions

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttnFn | None = None,
        logits_index: torch.Tensor | None = None,
        kernels: object | None = None,
    ) -> torch.Tensor:
        """``kernels``: fused CPU ops (``zeal.inference.kernels``) for LayerNorm with the
        residual add and GELU, used without autograd (serving)."""
        if attn is None:
            def attn(_layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return dense_causal_attention(q, k, v)

        if kernels is not None and not torch.is_grad_enabled():
            return self._fused_forward(input_ids, positions, attn, logits_index, kernels)
        tr = self.gpt.transformer
        t, c, nh = input_ids.shape[0], self.config.n_embd, self.config.n_head
        x = tr.wte(input_ids) + tr.wpe(positions)
        for i, block in enumerate(tr.h):
            h = block.ln_1(x)
            q, k, v = block.attn.c_attn(h).split(c, dim=-1)
            y = attn(i, q.view(t, nh, c // nh), k.view(t, nh, c // nh), v.view(t, nh, c // nh))
            x = x + block.attn.c_proj(y.reshape(t, c))
            x = x + block.mlp.c_proj(F.gelu(block.mlp.c_fc(block.ln_2(x)), approximate="tanh"))
        if logits_index is not None:
            x = x[logits_index]
        return self.gpt.lm_head(tr.ln_f(x))

    def _fused_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttnFn,
                       logits_index: torch.Tensor | None, ops) -> torch.Tensor:
        """The same blocks with fused CPU kernels: every LayerNorm also adds the residual
        branch into ``x`` in place, GELU overwrites the MLP's hidden activations."""
        tr = self.gpt.transformer
        t, c, nh = input_ids.shape[0], self.config.n_embd, self.config.n_head
        x = tr.wte(input_ids) + tr.wpe(positions)
        h = torch.empty_like(x)
        blocks = tr.h
        ln = blocks[0].ln_1
        ops.layer_norm(x, None, ln.weight, ln.bias, ln.eps, h)
        for i, block in enumerate(blocks):
            q, k, v = block.attn.c_attn(h).split(c, dim=-1)
            y = attn(i, q.view(t, nh, c // nh), k.view(t, nh, c // nh), v.view(t, nh, c // nh))
            ln = block.ln_2
            ops.layer_norm(x, block.attn.c_proj(y.reshape(t, c)), ln.weight, ln.bias, ln.eps, h)
            u = block.mlp.c_fc(h)
            ops.gelu_tanh(u)
            ln = blocks[i + 1].ln_1 if i + 1 < len(blocks) else tr.ln_f
            ops.layer_norm(x, block.mlp.c_proj(u), ln.weight, ln.bias, ln.eps, h)
        if logits_index is not None:
            h = h[logits_index]
        return self.gpt.lm_head(h)
