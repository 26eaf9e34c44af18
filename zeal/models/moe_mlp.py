"""An MoE MLP slot for zeal's GPT and Llama: every ``moe_every``-th block's MLP becomes a
:class:`zeal.moe.MoE` of ``num_experts`` copies of that MLP.

The model config carries ``num_experts`` (0 = dense), ``moe_every``, ``top_k``,
``capacity_factor``, ``aux_loss_coef`` and ``ep_size``. Blocks ``i`` with
``(i + 1) % moe_every == 0`` are MoE blocks (``moe_every=2``: every other block, the
second first, as Megatron-DeepSpeed's expert interval). In training the router drops
tokens beyond capacity (random token selection) and samples top-2's second expert with
Gumbel noise; in eval and serving every token goes to its top-k experts (no capacity
dropping, no noise), so serving equals a plain per-token mixture.
The language-model loss adds ``aux_loss_coef`` times the sum of the layers' aux losses.

Hugging Face MoE formats (:mod:`zeal.models.hf_moe`) add: top-k beyond 2 and
``norm_topk_prob`` (softmax over every expert, the k most probable, weights
renormalised or not: :func:`zeal.moe.gating.topkgating`), dropless training
(``drop_tokens=False``: no capacity dropping and no routing noise in training either,
as those models were trained), and Qwen2-MoE's shared expert: an MLP every token goes
through, scaled by ``sigmoid(shared_expert_gate(x))`` and added to the routed output.
"""

from __future__ import annotations

import torch
from torch import nn

from zeal.moe.layer import MoE  # the layer side of zeal.moe (below models; see zeal/moe/__init__.py)


def is_moe_block(num_experts: int, moe_every: int, layer_idx: int) -> bool:
    """Whether block ``layer_idx`` holds an MoE MLP."""
    return num_experts > 0 and (layer_idx + 1) % moe_every == 0


def check_moe_config(num_experts: int, moe_every: int, top_k: int, capacity_factor: float, ep_size: int) -> None:
    """One clear line for a bad MoE shape."""
    if num_experts < 0 or moe_every < 1 or top_k < 1 or capacity_factor <= 0 or ep_size < 1:
        raise ValueError(f"model MoE settings: num_experts {num_experts} >= 0, moe_every {moe_every} >= 1, "
                         f"top_k {top_k} >= 1, capacity_factor {capacity_factor} > 0, ep_size {ep_size} >= 1")
    if num_experts and num_experts % ep_size:
        raise ValueError(f"model.num_experts {num_experts} is not divisible by ep_size {ep_size}")
    if num_experts and top_k > num_experts:
        raise ValueError(f"model.top_k {top_k} exceeds num_experts {num_experts}")


class MoEMLP(nn.Module):
    """``forward(x, ops=None)`` like a dense MLP; the last forward's aux loss in ``l_aux``.
    ``drop_tokens=False``: dropless in training too; ``norm_topk_prob``: see
    :class:`~zeal.moe.gating.TopKGate`; ``shared_expert``: an MLP for every token, gated
    by ``shared_expert_gate`` (Linear hidden → 1, no bias) through a sigmoid."""

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int, top_k: int, capacity_factor: float,
                 ep_size: int, *, drop_tokens: bool = True, norm_topk_prob: bool | None = None,
                 shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        self.moe = MoE(hidden_size, expert, num_experts, ep_size=ep_size, k=top_k, capacity_factor=capacity_factor,
                       eval_capacity_factor=capacity_factor, min_capacity=1, dispatch="sort")
        self.moe.deepspeed_moe.gate.norm_topk_prob = norm_topk_prob
        self.drop_tokens = drop_tokens
        if shared_expert is not None:
            self.shared_expert = shared_expert
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        self.l_aux: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, ops: object | None = None) -> torch.Tensor:
        gate = self.moe.deepspeed_moe.gate
        # eval / serving: no capacity dropping, the second expert by the logits (no Gumbel noise)
        gate.drop_tokens = gate.second_expert_sampling = self.training and self.drop_tokens
        out, self.l_aux, _ = self.moe(x)
        if hasattr(self, "shared_expert"):
            shared = self.shared_expert(x, ops) if ops is not None else self.shared_expert(x)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out


def moe_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Sum of the aux losses of the last forward over the model's MoE MLPs (None if none)."""
    losses = [m.l_aux for m in model.modules() if isinstance(m, MoEMLP) and m.l_aux is not None]
    return torch.stack([loss.float() for loss in losses]).sum() if losses else None
