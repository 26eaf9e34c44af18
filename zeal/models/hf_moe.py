"""Hugging Face Mixtral folders as zeal Llama models with an MoE MLP in every layer.

Mixtral is Llama-shaped except its MLP: a router ``gate`` (hidden → experts, no bias)
and ``num_local_experts`` SwiGLU experts, each token going to its
``num_experts_per_tok`` = 2 highest-probability experts with the two softmax
probabilities renormalised — zeal's top-2 gating without capacity dropping (what eval
and serving use). Expert weights come either per expert (``block_sparse_moe.experts.<j>
.w1/w2/w3``: gate, down, up) or fused per layer as transformers 5 keeps them
(``mlp.experts.gate_up_proj [E, 2I, d]``, gate rows first, and ``mlp.experts.down_proj
[E, d, I]``).
"""

from __future__ import annotations

import re

import torch

from zeal.models.llama import LlamaConfig

MOE_TYPES = {"mixtral"}
_EXPERTS = "mlp.moe.deepspeed_moe.experts.deepspeed_experts"
_LEGACY = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def mixtral_config(d: dict) -> LlamaConfig:
    """A Llama config with every layer's MLP an MoE of ``num_local_experts`` experts."""
    cfg = LlamaConfig.from_hf(d)
    cfg.num_experts = int(d["num_local_experts"])
    cfg.top_k = int(d.get("num_experts_per_tok", 2))
    cfg.moe_every = 1
    cfg.aux_loss_coef = float(d.get("router_aux_loss_coef", 0.001))
    cfg.__post_init__()  # checks the MoE shape (top_k 1 or 2)
    return cfg


def mixtral_state_from_hf(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face Mixtral names → zeal's (router and experts; the rest is Llama's)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        m = re.match(r"(model\.layers\.\d+)\.(?:block_sparse_moe|mlp)\.(.*)$", name)
        if m is None:
            out[name] = t
            continue
        layer, rest = m.groups()
        if rest == "gate.weight":
            out[f"{layer}.mlp.moe.deepspeed_moe.gate.wg.weight"] = t
        elif (e := re.match(r"experts\.(\d+)\.(w[123])\.weight$", rest)) is not None:
            out[f"{layer}.{_EXPERTS}.{e.group(1)}.{_LEGACY[e.group(2)]}.weight"] = t
        elif rest == "experts.gate_up_proj":
            inter = t.shape[1] // 2
            for j in range(t.shape[0]):
                out[f"{layer}.{_EXPERTS}.{j}.gate_proj.weight"] = t[j, :inter]
                out[f"{layer}.{_EXPERTS}.{j}.up_proj.weight"] = t[j, inter:]
        elif rest == "experts.down_proj":
            for j in range(t.shape[0]):
                out[f"{layer}.{_EXPERTS}.{j}.down_proj.weight"] = t[j]
        else:
            raise ValueError(f"unexpected Mixtral tensor {name!r}")
    return out


_TO_LEGACY = {v: k for k, v in _LEGACY.items()}
_ZEAL_ONLY = ("num_experts", "moe_every", "top_k", "capacity_factor", "aux_loss_coef", "ep_size")


def mixtral_config_to_hf(cfg: LlamaConfig) -> dict:
    """The ``config.json`` of a Mixtral folder for a zeal Llama whose every MLP is an MoE
    of SwiGLU experts with top-2 routing (the layout :func:`mixtral_config` reads)."""
    if cfg.moe_every != 1 or cfg.top_k != 2 or cfg.mlp_bias:
        raise ValueError(f"an MoE Llama exports as Mixtral only with moe_every 1, top_k 2 and no MLP bias "
                         f"(this one: moe_every {cfg.moe_every}, top_k {cfg.top_k}, mlp_bias {cfg.mlp_bias})")
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
