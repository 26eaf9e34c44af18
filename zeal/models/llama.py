"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM): RoPE, RMSNorm, SwiGLU, GQA.

Parameter names follow Hugging Face's ``LlamaForCausalLM`` layout
(``model.layers.0.self_attn.q_proj.weight`` ...), so a ``transformers`` folder
loads with no renaming. The forward pass works on a *flat* batch of tokens
``(T,)`` with their absolute positions: the attention over past tokens is
delegated to an ``attn`` callable (the serving engine passes one that reads and
writes a paged KV cache; :func:`dense_causal_attention` serves one sequence with
no cache). Linear layers therefore see every token of a ragged batch at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from zeal.models.checkpointing import Checkpointable, CheckpointPolicy, run_blocks

# attn(layer_idx, q (T, n_head, hd), k (T, n_kv, hd), v (T, n_kv, hd)) -> (T, n_head, hd)
AttnFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class LlamaConfig:
    """Shape of a Llama-family model (the subset of the HF config zeal uses)."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: True (q/k/v only)
    mlp_bias: bool = False
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )

    @classmethod
    def from_hf(cls, d: dict) -> LlamaConfig:
        """Build from a ``config.json`` dict (transformers 4.x ``rope_theta``/``rope_scaling``
        or 5.x ``rope_parameters``)."""
        rope = d.get("rope_parameters") or {}
        scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        model_type = d.get("model_type", "llama")
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim"),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", d.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=d.get("attention_bias", model_type == "qwen2"),
            mlp_bias=d.get("mlp_bias", False),
            model_type=model_type,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
        )

    def to_hf(self) -> dict:
        d = asdict(self)
        d.pop("extra")
        d["architectures"] = ["Qwen2ForCausalLM" if self.model_type == "qwen2" else "LlamaForCausalLM"]
        d["hidden_act"] = "silu"
        return d


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies ``(head_dim/2,)``, with HF's ``linear`` and ``llama3`` scalings."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    s = cfg.rope_scaling
    if not s:
        return inv.float()
    kind = s.get("rope_type", s.get("type"))
    if kind == "linear":
        return (inv / s["factor"]).float()
    if kind == "llama3":
        factor, lo, hi = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
        old = s.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        return torch.where(is_mid, mid, scaled).float()
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: none, linear, llama3)")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF ("rotate half") layout. x: (T, heads, hd); cos/sin: (T, 1, hd)."""
    h = x.shape[-1] // 2
    out = x * cos  # plus rotate_half(x) * sin, without materialising the rotated copy
    out[..., :h] -= x[..., h:] * sin[..., :h]
    out[..., h:] += x[..., :h] * sin[..., h:]
    return out


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention for one sequence: q (T, nh, hd), k/v (T, nkv, hd) -> (T, nh, hd)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    # 4-D (1, heads, T, hd): the fused CPU/CUDA kernels want a batch dimension
    y = F.scaled_dot_product_attention(*(z.transpose(0, 1)[None] for z in (q, k, v)), is_causal=True)
    return y[0].transpose(0, 1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # serving: the same arithmetic, in place (see LlamaMLP)
            xf = x.to(torch.float32, copy=True)
            xf.mul_(torch.rsqrt(xf.square().mean(-1, keepdim=True).add_(self.eps)))
            return xf.to(x.dtype).mul_(self.weight)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        d, b = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(d, self.nh * self.hd, bias=b)
        self.k_proj = nn.Linear(d, self.nkv * self.hd, bias=b)
        self.v_proj = nn.Linear(d, self.nkv * self.hd, bias=b)
        self.o_proj = nn.Linear(self.nh * self.hd, d, bias=cfg.attention_bias and cfg.model_type != "qwen2")


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        d, i, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(d, i, bias=b)
        self.up_proj = nn.Linear(d, i, bias=b)
        self.down_proj = nn.Linear(i, d, bias=b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            # serving: overwrite the gate's fresh output instead of writing two new
            # activation-sized tensors (512-token CPU passes 2-5 % faster, bit-identical)
            return self.down_proj(F.silu(self.gate_proj(x), inplace=True).mul_(self.up_proj(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # what ``attn`` is told (the paged KV cache is per layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttnFn) -> torch.Tensor:
        """One decoder layer over a flat batch: x (T, d); cos/sin (T, 1, hd)."""
        t, a = x.shape[0], self.self_attn
        h = self.input_layernorm(x)
        q = apply_rope(a.q_proj(h).view(t, a.nh, a.hd), cos, sin)
        k = apply_rope(a.k_proj(h).view(t, a.nkv, a.hd), cos, sin)
        v = a.v_proj(h).view(t, a.nkv, a.hd)
        x = x + a.o_proj(attn(self.layer_idx, q, k, v).reshape(t, a.nh * a.hd))
        return x + self.mlp(self.post_attention_layernorm(x))


class _LlamaTrunk(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Llama(nn.Module, Checkpointable):
    """Llama-family causal LM over a flat token batch.

    ``forward(input_ids (T,), positions (T,), attn, logits_index=None)`` returns
    logits ``(T', vocab)`` for the rows picked by ``logits_index`` (all rows when
    None), so that a serving step projects only the tokens it samples from.
    ``checkpoint_activations = True`` recomputes each layer in backward (training
    forwards only: ``attn`` then runs twice per layer, so it must have no side
    effects, as :func:`dense_causal_attention` has none).
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = _LlamaTrunk(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.checkpoint_policy = CheckpointPolicy()

    def layer_stack(self) -> nn.ModuleList:
        """The decoder layers (what activation checkpointing groups)."""
        return self.model.layers

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_key_value_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttnFn | None = None,
        logits_index: torch.Tensor | None = None,
        kernels: object | None = None,
    ) -> torch.Tensor:
        """``kernels``: fused CPU ops (``zeal.inference.kernels``) for RMSNorm with the
        residual add, RoPE and SiLU-gating, used without autograd (serving)."""
        if attn is None:  # one sequence, no cache
            def attn(_layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return dense_causal_attention(q, k, v)

        if kernels is not None and not torch.is_grad_enabled():
            return self._fused_forward(input_ids, positions, attn, logits_index, kernels)
        x = self.model.embed_tokens(input_ids)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (T, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # (T, 1, hd)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        x = run_blocks(self.model.layers, x, self.checkpoint_policy, cos, sin, attn)
        if logits_index is not None:
            x = x[logits_index]
        return self.lm_head(self.model.norm(x))

    def _fused_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttnFn,
                       logits_index: torch.Tensor | None, ops) -> torch.Tensor:
        """The same layers with fused elementwise kernels: each RMSNorm also adds the
        residual branch into ``x`` in place, RoPE rotates q and k in place (cos/sin in
        fp32), SiLU-gating overwrites the gate."""
        x = self.model.embed_tokens(input_ids)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (T, hd/2)
        cos, sin = freqs.cos(), freqs.sin()
        t, layers = input_ids.shape[0], self.model.layers
        h = torch.empty_like(x)
        norm = layers[0].input_layernorm
        ops.rms_norm(x, None, norm.weight, norm.eps, h)
        for i, layer in enumerate(layers):
            a, mlp = layer.self_attn, layer.mlp
            q, k = a.q_proj(h).view(t, a.nh, a.hd), a.k_proj(h).view(t, a.nkv, a.hd)
            v = a.v_proj(h).view(t, a.nkv, a.hd)
            ops.rope(q, k, cos, sin)
            o = a.o_proj(attn(i, q, k, v).reshape(t, a.nh * a.hd))
            norm = layer.post_attention_layernorm
            ops.rms_norm(x, o, norm.weight, norm.eps, h)  # x += o; h = norm(x)
            gate = mlp.gate_proj(h)
            ops.silu_mul(gate, mlp.up_proj(h))
            norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            ops.rms_norm(x, mlp.down_proj(gate), norm.weight, norm.eps, h)
        if logits_index is not None:
            h = h[logits_index]
        return self.lm_head(h)
