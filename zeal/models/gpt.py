"""zeal's own GPT: the GPT-2 architecture, single-device.

Pre-LayerNorm blocks, learned positions, GELU (tanh) MLP, biases everywhere and
an LM head tied to the token embedding. Parameter names follow Hugging Face's
GPT-2 layout (``transformer.h.0.attn.c_attn.weight`` ...) so that export to a
``transformers`` folder is a rename plus a transpose of the linear weights
(GPT-2 stores them as ``Conv1D``, i.e. ``(in, out)``).

One module for training and serving: every :class:`Block` has its own
``forward(x, attention)``, given dense causal attention in training and the serving
engine's paged attention (a flat ragged batch ``(T, C)``) in serving, where the
attention object may also select the fused CPU kernels (see :mod:`zeal.models.attention`).
GPT needs no positions inside its blocks: learned position embeddings are added once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zeal.models.attention import DENSE, Attention, fused_ops, residual_stream
from zeal.models.checkpointing import Checkpointable, CheckpointPolicy, causal_lm_loss, run_blocks
from zeal.models.moe_mlp import MoEMLP, check_moe_config, is_moe_block, moe_aux_loss
from zeal.moe.layer import apply_global


@dataclass
class GPTConfig:
    """Shape of a GPT. ``n_embd`` must be divisible by ``n_head``."""

    vocab_size: int = 4096
    n_positions: int = 256
    n_embd: int = 128
    n_layer: int = 4
    n_head: int = 4
    dropout: float = 0.0
    layer_norm_epsilon: float = 1e-5
    # mixture of experts (zeal.models.moe_mlp): 0 experts = dense
    num_experts: int = 0
    moe_every: int = 2
    top_k: int = 1
    capacity_factor: float = 1.0
    aux_loss_coef: float = 0.01
    ep_size: int = 1
    drop_tokens: bool = True  # False: dropless training (no capacity, no routing noise)

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"model.n_embd {self.n_embd} is not divisible by model.n_head {self.n_head}")
        check_moe_config(self.num_experts, self.moe_every, self.top_k, self.capacity_factor, self.ep_size)

    def to_dict(self) -> dict:
        return asdict(self)

    def num_parameters(self) -> int:
        """Parameter count with the tied head counted once."""
        d, v, p, n_layer = self.n_embd, self.vocab_size, self.n_positions, self.n_layer
        mlp = (d * 4 * d + 4 * d) + (4 * d * d + d)
        block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + mlp
        moe_blocks = sum(is_moe_block(self.num_experts, self.moe_every, i) for i in range(n_layer))
        extra = moe_blocks * ((self.num_experts - 1) * mlp + d * self.num_experts)  # more experts, the router
        return v * d + p * d + n_layer * block + 2 * d + extra


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` that can first add a residual branch into ``x`` in place:
    ``norm(x, add=d, ops=ops)`` does ``x += d`` (serving only) and returns the normalised
    ``x``, in one pass when given fused ``ops``."""

    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None, ops: object | None = None) -> torch.Tensor:
        if ops is None:
            return super().forward(x if add is None else x.add_(add))
        out = torch.empty_like(x, dtype=self.weight.dtype)  # x may be an fp32 residual stream
        ops.layer_norm(x, add, self.weight, self.bias, self.eps, out)
        return out


class CausalSelfAttention(nn.Module):
    """Fused q/k/v projection, attention by the pass's attention object, output projection."""

    def __init__(self, cfg: GPTConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.layer_idx = layer_idx  # what ``attention`` is told (the paged KV cache is per layer)
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, attention: Attention = DENSE) -> torch.Tensor:
        """x (..., T, C) -> (..., T, C); leading dims: a batch, or none (a flat serving batch)."""
        lead = x.shape[:-1]
        width = self.n_head * self.head_dim  # n_embd, or this rank's heads under tensor parallelism
        # (..., T, nh, hs) each
        q, k, v = (z.view(*lead, self.n_head, self.head_dim) for z in self.c_attn(x).split(width, dim=-1))
        y = attention(self.layer_idx, q, k, v, dropout_p=self.dropout if self.training else 0.0)
        return self.c_proj(y.reshape(*lead, width))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor, ops: object | None = None) -> torch.Tensor:
        if ops is None:
            return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))
        u = self.c_fc(x)
        ops.gelu_tanh(u)  # in place on the fresh hidden activations
        return self.c_proj(u)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``forward(x, attention)``, x ``(..., T, C)``.

    The one forward of a GPT layer, for training (dense attention, autograd) and
    serving (paged attention). When the attention object carries fused ops and grad
    is off, each LayerNorm also adds the residual branch into ``x`` in place and GELU
    overwrites the MLP's hidden activations: the same arithmetic in fewer passes."""

    def __init__(self, cfg: GPTConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = CausalSelfAttention(cfg, layer_idx)
        self.ln_2 = LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = MLP(cfg)
        if is_moe_block(cfg.num_experts, cfg.moe_every, layer_idx):
            self.mlp = MoEMLP(cfg.n_embd, self.mlp, cfg.num_experts, cfg.top_k, cfg.capacity_factor, cfg.ep_size,
                              drop_tokens=cfg.drop_tokens)

    def forward(self, x: torch.Tensor, attention: Attention = DENSE) -> torch.Tensor:
        ops = fused_ops(attention)
        if ops is None:
            x = x + self.attn(self.ln_1(x), attention)
            return x + self.mlp(self.ln_2(x))
        # serving: x is this pass's own residual stream, updated in place
        h = self.ln_2(x, add=self.attn(self.ln_1(x, ops=ops), attention), ops=ops)  # x += attn; h = ln_2(x)
        return x.add_(self.mlp(h, ops))


class _Trunk(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)


class GPT(nn.Module, Checkpointable):
    """GPT-2 style decoder, one module for training and serving.

    ``forward(input_ids (B, T), labels=None)`` returns logits, or the mean next-token
    cross-entropy when ``labels`` is given (labels are the inputs; the shift happens
    inside; ``-100`` is ignored). Serving passes a flat batch ``input_ids (T,)`` with
    ``positions (T,)``, a paged ``attention`` object and ``logits_index`` (the rows to
    project). ``checkpoint_activations = True`` (or ``gradient_checkpointing_enable()``)
    recomputes each block in backward."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.transformer = _Trunk(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied
        self.checkpoint_policy = CheckpointPolicy()
        if not any(p.is_meta for p in self.parameters()):
            apply_global(self, self._init_weights)  # MoE experts sliced at build: one process's draws

    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2 initialisation, applied per module (also used by zeal's meta-device
        materialisation, which calls it one module at a time)."""
        std = 0.02
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, std)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def layer_stack(self) -> nn.ModuleList:
        """The transformer blocks (what activation checkpointing groups)."""
        return self.transformer.h

    # what the serving engine sizes its KV cache and context by
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

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *,
                positions: torch.Tensor | None = None, attention: Attention = DENSE,
                logits_index: torch.Tensor | None = None, hidden_only: bool = False) -> torch.Tensor:
        """``input_ids`` (B, T), or (T,) for a flat serving batch; ``positions`` default
        ``arange(T)``; ``logits_index`` picks the rows of the flat batch to project (of a
        (B, T) batch: the positions, e.g. an RLHF answer's); ``hidden_only``: the final
        norm's output, the head's input (a caller scoring the head itself: sequence
        parallelism's tiled loss)."""
        if positions is None:
            t = input_ids.shape[-1]
            if t > self.config.n_positions:
                raise ValueError(f"sequence length {t} exceeds model.n_positions {self.config.n_positions}")
            positions = torch.arange(t, device=input_ids.device)
        tr = self.transformer
        x = tr.drop(residual_stream(tr.wte(input_ids), fused_ops(attention)) + tr.wpe(positions))
        x = run_blocks(tr.h, x, self.checkpoint_policy, attention)
        if logits_index is not None:
            x = x[logits_index] if x.dim() == 2 else x[:, logits_index]
        h = tr.ln_f(x, ops=fused_ops(attention))
        if hidden_only:
            return h
        if labels is None:
            return self.lm_head(h)
        loss = causal_lm_loss(self.lm_head, h, labels, self.checkpoint_policy)
        aux = moe_aux_loss(self) if self.config.num_experts else None
        return loss if aux is None else loss + self.config.aux_loss_coef * aux

    @torch.no_grad()
    def generate(
        self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Plain sampling without a KV cache (the serving engine lives in ``zeal.inference``)."""
        return generate_plain(self, input_ids, max_new_tokens, temperature, top_k, generator)


def generate_plain(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                   top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """``input_ids (B, T)`` plus ``max_new_tokens`` sampled by re-running the model's dense
    forward on the last ``model.max_positions`` tokens each time (no KV cache: a reference)."""
    for _ in range(max_new_tokens):
        ctx = input_ids[:, -model.max_positions :]
        nxt = sample_next(model(ctx)[:, -1], temperature, top_k, generator)
        input_ids = torch.cat([input_ids, nxt], dim=1)
    return input_ids


def sample_next(logits: torch.Tensor, temperature: float, top_k: int | None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids (B, 1) from last-position logits (B, V): greedy at temperature
    <= 0, else temperature and optional top-k sampling."""
    logits = logits.float()
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
