"""Hugging Face MoE folders (Mixtral, Qwen2-MoE, OLMoE) as zeal Llama models with MoE MLPs.

All three are Llama-shaped except their MLP: a router ``gate`` (hidden → experts, no
bias) and SwiGLU experts; every token goes to its ``num_experts_per_tok`` most probable
experts (softmax over all experts, then top-k), weighted by those probabilities,
renormalised over the k when ``norm_topk_prob`` (always in Mixtral). They were trained
without capacity dropping, so zeal builds them dropless in training as in serving
(:func:`zeal.moe.gating.topkgating`), and adds the router's aux loss only when the
config asks for it (``output_router_logits``, as Hugging Face's loss does).

* Mixtral: every layer MoE.
* Qwen2-MoE: q/k/v biases (``qkv_bias``), experts of ``moe_intermediate_size``, a shared
  expert (``shared_expert_intermediate_size``) gated by ``sigmoid(shared_expert_gate(x))``
  and added to the routed output; layer i is MoE when ``(i + 1) % decoder_sparse_step == 0``
  and i is not in ``mlp_only_layers`` (dense MLPs of ``intermediate_size`` otherwise).
* OLMoE: RMSNorm over the whole q and k projections (``q_norm``, ``k_norm``), optional
  ``clip_qkv``; every layer MoE.

Expert weights come either per expert (``block_sparse_moe.experts.<j>.w1/w2/w3``: gate,
down, up; or ``mlp.experts.<j>.gate_proj/up_proj/down_proj``) or fused per layer as
transformers 5 keeps them in memory (``mlp.experts.gate_up_proj [E, 2I, d]``, gate rows
first, and ``mlp.experts.down_proj [E, d, I]``). A config key zeal cannot express is
refused by name.
"""

from __future__ import annotations

import re

import torch

from zeal.models.llama_config import LlamaConfig

MOE_TYPES = {"mixtral", "qwen2_moe", "olmoe"}
_EXPERTS = "mlp.moe.deepspeed_moe.experts.deepspeed_experts"
_LEGACY = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def _refuse(d: dict, mt: str) -> None:
    """One clear line for a key of the format that zeal's Llama cannot express."""
    bad = []
    if d.get("hidden_act", "silu") != "silu":
        bad.append(f"hidden_act {d['hidden_act']!r} (zeal's experts are SwiGLU with silu)")
    if d.get("use_sliding_window"):
        bad.append("use_sliding_window true (sliding-window attention)")
    kinds = set(d.get("layer_types") or []) - {"full_attention"}
    if kinds:
        bad.append(f"layer_types {sorted(kinds)} (only full_attention)")
    if d.get("mlp_bias"):
        bad.append("mlp_bias true")
    if bad:
        raise ValueError(f"{mt} config key {bad[0]} is not supported by zeal")


def _moe(cfg: LlamaConfig, d: dict, experts_key: str, every: int) -> LlamaConfig:
    cfg.num_experts = int(d[experts_key])
    cfg.top_k = int(d.get("num_experts_per_tok", 2))
    cfg.moe_every = every
    cfg.drop_tokens = False
    cfg.aux_loss_coef = float(d.get("router_aux_loss_coef", 0.001)) if d.get("output_router_logits") else 0.0
    cfg.__post_init__()  # checks the MoE shape
    return cfg


def mixtral_config(d: dict) -> LlamaConfig:
    """A Llama config with every layer's MLP an MoE of ``num_local_experts`` experts."""
    _refuse(d, "mixtral")
    cfg = LlamaConfig.from_hf(d)
    cfg.norm_topk_prob = True
    return _moe(cfg, d, "num_local_experts", 1)


def qwen2_moe_config(d: dict) -> LlamaConfig:
    """A Llama config of a Qwen2-MoE folder (see the module docstring)."""
    _refuse(d, "qwen2_moe")
    cfg = LlamaConfig.from_hf(d)
    cfg.attention_bias = bool(d.get("qkv_bias", True))
    cfg.moe_intermediate_size = d.get("moe_intermediate_size")
    cfg.shared_expert_intermediate_size = int(d.get("shared_expert_intermediate_size") or 0)
    cfg.norm_topk_prob = bool(d.get("norm_topk_prob", False))
    cfg.mlp_only_layers = [int(i) for i in d.get("mlp_only_layers") or []]
    return _moe(cfg, d, "num_experts", int(d.get("decoder_sparse_step", 1)))


def olmoe_config(d: dict) -> LlamaConfig:
    """A Llama config of an OLMoE folder (see the module docstring)."""
    _refuse(d, "olmoe")
    cfg = LlamaConfig.from_hf(d)
    cfg.qk_norm = True
    cfg.clip_qkv = d.get("clip_qkv")
    cfg.norm_topk_prob = bool(d.get("norm_topk_prob", False))
    return _moe(cfg, d, "num_experts", 1)


def moe_config(d: dict) -> LlamaConfig:
    """The Llama config of a Mixtral, Qwen2-MoE or OLMoE ``config.json``."""
    build = {"mixtral": mixtral_config, "qwen2_moe": qwen2_moe_config, "olmoe": olmoe_config}[d["model_type"]]
    return build(d)


def moe_state_from_hf(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face MoE names → zeal's (routers and experts; shared experts, dense MLPs
    and the rest are Llama's names already)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        m = re.match(r"(model\.layers\.\d+)\.(?:block_sparse_moe|mlp)\.(.*)$", name)
        if m is None or re.match(r"(shared_expert\.|shared_expert_gate\.|(gate|up|down)_proj\.)", m.group(2)):
            out[name] = t
            continue
        layer, rest = m.groups()
        if rest == "gate.weight":
            out[f"{layer}.mlp.moe.deepspeed_moe.gate.wg.weight"] = t
        elif (e := re.match(r"experts\.(\d+)\.(w[123]|gate_proj|up_proj|down_proj)\.weight$", rest)) is not None:
            out[f"{layer}.{_EXPERTS}.{e.group(1)}.{_LEGACY.get(e.group(2), e.group(2))}.weight"] = t
        elif rest == "experts.gate_up_proj":
            inter = t.shape[1] // 2
            for j in range(t.shape[0]):
                out[f"{layer}.{_EXPERTS}.{j}.gate_proj.weight"] = t[j, :inter]
                out[f"{layer}.{_EXPERTS}.{j}.up_proj.weight"] = t[j, inter:]
        elif rest == "experts.down_proj":
            for j in range(t.shape[0]):
                out[f"{layer}.{_EXPERTS}.{j}.down_proj.weight"] = t[j]
        else:
            raise ValueError(f"unexpected MoE tensor {name!r}")
    return out


mixtral_state_from_hf = moe_state_from_hf  # the name the Mixtral loader had


_TO_LEGACY = {v: k for k, v in _LEGACY.items()}
_ZEAL_ONLY = ("num_experts", "moe_every", "top_k", "capacity_factor", "aux_loss_coef", "ep_size",
              "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob", "drop_tokens",
              "mlp_only_layers", "qk_norm", "clip_qkv")


def mixtral_config_to_hf(cfg: LlamaConfig) -> dict:
    """The ``config.json`` of a Mixtral folder for a zeal Llama whose every MLP is an MoE
    of SwiGLU experts with top-2 routing (the layout :func:`mixtral_config` reads)."""
    if cfg.moe_every != 1 or cfg.top_k != 2 or cfg.mlp_bias:
        raise ValueError(f"an MoE Llama exports as Mixtral only with moe_every 1, top_k 2 and no MLP bias "
                         f"(this one: moe_every {cfg.moe_every}, top_k {cfg.top_k}, mlp_bias {cfg.mlp_bias})")
    other = [k for k in ("shared_expert_intermediate_size", "mlp_only_layers", "qk_norm", "clip_qkv",
                         "moe_intermediate_size") if getattr(cfg, k)]
    if cfg.norm_topk_prob is False:
        other.append("norm_topk_prob")
    if other or cfg.model_type in ("qwen2_moe", "olmoe"):
        raise ValueError(f"an MoE Llama of model_type {cfg.model_type!r} (with {', '.join(other) or 'its layout'}) "
                         "has no Mixtral layout to export as")
    d = cfg.to_hf()
    for k in _ZEAL_ONLY:
        d.pop(k, None)
    d.update(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=cfg.num_experts,
             num_experts_per_tok=cfg.top_k, router_aux_loss_coef=cfg.aux_loss_coef)
    return d


def mixtral_name_to_hf(name: str) -> str:
    """zeal's name of a router or expert tensor → Mixtral's per-expert one (others unchanged)."""
    m = re.match(r"(model\.layers\.\d+)\.mlp\.moe\.deepspeed_moe\.(.*)$", name)
    if m is None:
        return name
    layer, rest = m.groups()
    if rest == "gate.wg.weight":
        return f"{layer}.block_sparse_moe.gate.weight"
    e = re.match(r"experts\.deepspeed_experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", rest)
    if e is None:
        raise ValueError(f"no Mixtral name for {name!r}")
    return f"{layer}.block_sparse_moe.experts.{e.group(1)}.{_TO_LEGACY[e.group(2)]}.weight"
