"""The shape of a Llama-family model: :class:`LlamaConfig` (read from and written to a
Hugging Face ``config.json``) and the rotary frequencies it implies. Apart from
:mod:`zeal.models.llama` so that the model and the Hugging Face folder code
(:mod:`zeal.models.hf_folder`, :mod:`zeal.models.hf_moe`) both build on it without importing
each other; ``zeal.models.llama.LlamaConfig`` stays its public name."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from zeal.models.moe_mlp import check_moe_config

__all__ = ["LlamaConfig", "rope_inv_freq"]


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
    initializer_range: float = 0.02  # std of the normal init of linear and embedding weights
    attention_bias: bool = False  # Qwen2: True (q/k/v only)
    mlp_bias: bool = False
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict = field(default_factory=dict)
    # mixture of experts (zeal.models.moe_mlp): 0 experts = dense; not a Hugging Face layout
    num_experts: int = 0
    moe_every: int = 2
    top_k: int = 1
    capacity_factor: float = 1.0
    aux_loss_coef: float = 0.01
    ep_size: int = 1
    # Hugging Face MoE formats (zeal.models.hf_moe): Qwen2-MoE / OLMoE
    moe_intermediate_size: int | None = None  # the experts' width (None: intermediate_size)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert (0: none)
    norm_topk_prob: bool | None = None  # renormalise the top-k weights (None: DeepSpeed's top-1/top-2 rule)
    drop_tokens: bool = True  # False: dropless training (no capacity, no routing noise)
    mlp_only_layers: list[int] = field(default_factory=list)  # dense layers among the MoE ones
    qk_norm: bool = False  # OLMoE: RMSNorm over the whole q and k projections
    clip_qkv: float | None = None  # OLMoE: q, k, v clamped to [-clip_qkv, clip_qkv]

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        check_moe_config(self.num_experts, self.moe_every, self.top_k, self.capacity_factor, self.ep_size)

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
            initializer_range=d.get("initializer_range", 0.02),
            attention_bias=d.get("attention_bias", model_type == "qwen2"),
            mlp_bias=d.get("mlp_bias", False),
            model_type=model_type,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
        )

    def to_hf(self) -> dict:
        """The ``config.json`` dict (transformers' ``LlamaConfig`` / ``Qwen2Config`` keys).
        A dense model's carries no mixture-of-experts key (transformers would read
        ``top_k`` as a generation flag), nor OLMoE's ``qk_norm`` / ``clip_qkv`` when unset."""
        d = asdict(self)
        d.pop("extra")
        if not self.num_experts:
            for k in _MOE_KEYS:
                d.pop(k)
        if not self.qk_norm:
            d.pop("qk_norm")
        if self.clip_qkv is None:
            d.pop("clip_qkv")
        d["architectures"] = ["Qwen2ForCausalLM" if self.model_type == "qwen2" else "LlamaForCausalLM"]
        d["hidden_act"] = "silu"
        return d


_MOE_KEYS = ("num_experts", "moe_every", "top_k", "capacity_factor", "aux_loss_coef", "ep_size",
             "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob", "drop_tokens",
             "mlp_only_layers")
"""LlamaConfig's mixture-of-experts fields: left out of a dense model's ``config.json``."""


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies ``(head_dim/2,)``, with HF's ``linear`` and ``llama3`` scalings;
    on the CPU, also inside ``torch.device("meta")`` (on meta these ops run torch's Python
    references, whose first use imports the compiler: seconds of a process's start)."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64, device="cpu") / hd))
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
