"""Mixture of experts: DeepSpeed's MoE layer, gating, dispatch and expert parallelism."""

from zeal.moe.apply import apply_moe, model_ep_size, moe_layers
from zeal.moe.gating import Routing, TopKGate, capacity, top1gating, top2gating
from zeal.moe.layer import MoE, is_expert_param
from zeal.moe.tensor import moe_tensor_parallel  # registers the experts' tensor-parallel split rule

__all__ = ["MoE", "Routing", "TopKGate", "apply_moe", "capacity", "is_expert_param", "model_ep_size",
           "moe_layers", "moe_tensor_parallel", "top1gating", "top2gating"]
