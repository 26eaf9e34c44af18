"""Top-1 and top-2 gating as in DeepSpeed-MoE / GShard: routes, capacity, the aux loss.

The gates are pure functions of the router logits ``[S, E]`` (S tokens, E experts)
returning a :class:`Routing`: for each of the k choices of every token, the expert, the
slot in that expert's capacity buffer, the combine weight and whether the token was
kept. Both dispatch paths (the [S, E, C] one-hot einsum and the index-based sort
path, :mod:`zeal.moe.dispatch`) read it, so they route identically.

* capacity ``C = max(ceil(S / E · capacity_factor · k), min_capacity)``; with
  ``drop_tokens=False`` it is instead the largest per-expert count over the
  expert-parallel group (all-reduced max), so no token is dropped;
* top-1: the expert of largest probability (or of largest ``logits + Gumbel noise``
  under the ``RSample`` policy); beyond capacity, random token selection (``use_rts``)
  keeps ``C`` of an expert's tokens chosen by uniform random priority, otherwise the
  first ``C`` in token order; the combine weight is the softmax probability;
* top-2: the second expert is the arg-max of the logits (plus Gumbel noise when
  ``second_expert_sampling``) with the first masked out; its slots come after *all*
  first choices of that expert; both weights are renormalised over the kept choices;
* top-k (any k; k > 2, or a gate with ``norm_topk_prob`` set, as Hugging Face's
  Mixtral / Qwen2-MoE / OLMoE route): softmax over every expert, the k most probable;
  choice j's slots come after all choices < j of that expert; the weights are the
  probabilities, renormalised over the kept choices when ``normalize``; its
  ``l_aux = E · Σ_e mean_s(p_se) · count_e / (S · k)`` counts all k choices;
* ``l_aux = E · Σ_e mean_s(p_se) · frac_e`` where ``frac_e`` is the fraction of tokens
  whose FIRST choice is e (counted before dropping);
* ``exp_counts``: tokens routed to each expert (all k choices, before dropping).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zeal.dist.comm import Comm
from zeal.moe.recompute import agreed

NOISY_POLICIES = (None, "Jitter", "RSample")


@dataclass
class Routing:
    """Where every token goes. ``experts``/``slots``/``gates``/``kept`` are ``[k, S]``;
    a dropped choice has ``kept`` False and gate 0."""

    experts: torch.Tensor
    slots: torch.Tensor
    gates: torch.Tensor
    kept: torch.Tensor
    capacity: int
    num_experts: int
    l_aux: torch.Tensor
    exp_counts: torch.Tensor


def capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int, k: int = 1) -> int:
    """DeepSpeed's capacity: ``max(ceil(tokens / experts · capacity_factor · k), min_capacity)``."""
    return max(math.ceil(num_tokens / num_experts * capacity_factor * k), min_capacity)


def gumbel_noise(shape: torch.Size, device: torch.device) -> torch.Tensor:
    """Standard Gumbel samples ``-log(-log U)``."""
    u = torch.rand(shape, device=device).clamp_(1e-10, 1 - 1e-7)
    return -torch.log(-torch.log(u))


def multiplicative_jitter(x: torch.Tensor, eps: float = 1e-2) -> torch.Tensor:
    """The ``Jitter`` policy: the router input times uniform noise in [1 - eps, 1 + eps]."""
    return x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)


def _max_count(counts: torch.Tensor, ep: Comm | None) -> int:
    """``drop_tokens=False``: the capacity that drops nothing on any rank of the ep group."""
    local = int(counts.max()) if counts.numel() else 0
    if ep is not None and ep.active:  # (a checkpoint's recompute reuses the forward's value)
        local = int(agreed(lambda: ep.all_reduce_scalar(float(local), "max")))
    return max(local, 1)


def _frac(frac: torch.Tensor, sp: Comm | None) -> torch.Tensor:
    """The routed-token fractions of the whole sequences: the mean over the sp group of
    each chunk's (chunks hold equal token counts); as is without sequence parallelism."""
    if sp is None or not sp.active:
        return frac
    total = frac.detach().clone()
    sp.all_reduce(total, "control")
    return total / sp.size


def sequence_aux(local: torch.Tensor, sp: Comm | None) -> torch.Tensor:
    """Under sequence parallelism each rank's ``local`` aux (its chunk's mean gate
    probabilities against the whole sequences' fractions) is 1/S of the whole sequences'
    one: the value returned is their mean over sp (the aux loss one process computes),
    the gradient ``local``'s. As the language-model loss, every sp rank then carries S
    times its share, which the gradient mean over dp (= data × sp) divides back."""
    if sp is None or not sp.active:
        return local
    mean = local.detach().clone()
    sp.all_reduce(mean, "control")
    return local + (mean / sp.size - local).detach()


def _slots(mask: torch.Tensor) -> torch.Tensor:
    """[S, E] 0/1 → the slot of each token in its expert's buffer (token order)."""
    return torch.cumsum(mask, dim=0) - 1


def top1gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int,
               used_token: torch.Tensor | None = None, noisy_gate_policy: str | None = None,
               drop_tokens: bool = True, use_rts: bool = True, ep: Comm | None = None,
               sp: Comm | None = None) -> Routing:
    """Top-1 routing of ``logits`` [S, E] (see the module docstring)."""
    gates = F.softmax(logits.float(), dim=1)
    s, e = gates.shape
    cap = capacity(s, e, capacity_factor, min_capacity)
    pick = logits.float() + gumbel_noise(logits.shape, logits.device) if noisy_gate_policy == "RSample" else gates
    idx = torch.argmax(pick, dim=1)
    mask = F.one_hot(idx, e).to(torch.long)
    if used_token is not None:
        mask = mask * used_token.reshape(-1, 1).to(torch.long)
    exp_counts = mask.sum(dim=0).detach().cpu()
    l_aux = sequence_aux(torch.sum(gates.mean(dim=0) * _frac(mask.float().mean(dim=0), sp)) * e, sp)
    if not drop_tokens:
        cap = _max_count(exp_counts, ep)
    elif use_rts:  # keep a uniformly random C of each expert's tokens
        if s < min_capacity:
            raise ValueError(f"MoE top-1 gating: {s} tokens is fewer than min_capacity {min_capacity}")
        priority = mask.float() * torch.rand(mask.shape, device=mask.device)
        top = torch.topk(priority, k=min(cap, s), dim=0).indices
        mask = mask * torch.zeros_like(mask).scatter_(0, top, 1)
    else:  # the first C in token order
        mask = mask * (_slots(mask) < cap)
    slots = (_slots(mask) * mask).sum(dim=1)
    kept = mask.sum(dim=1) > 0
    gate = (gates * mask).sum(dim=1)
    return Routing(idx[None], slots[None], gate[None], kept[None], cap, e, l_aux, exp_counts)


def top2gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep: Comm | None = None, second_expert_sampling: bool = True, sp: Comm | None = None) -> Routing:
    """Top-2 routing of ``logits`` [S, E] (see the module docstring)."""
    gates = F.softmax(logits.float(), dim=1)
    s, e = gates.shape
    idx1 = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(idx1, e).to(torch.long)
    second = logits.float() + gumbel_noise(logits.shape, logits.device) if second_expert_sampling else logits.float()
    idx2 = torch.argmax(second.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(idx2, e).to(torch.long)
    loc1 = _slots(mask1)
    loc2 = _slots(mask2) + mask1.sum(dim=0, keepdim=True)  # second choices queue after all first ones
    l_aux = sequence_aux(torch.mean(gates.mean(dim=0) * _frac(mask1.float().mean(dim=0), sp)) * e * e, sp)
    exp_counts = (mask1 + mask2).sum(dim=0).detach().cpu()
    cap = capacity(s, e, capacity_factor, min_capacity, k=2) if drop_tokens else _max_count(exp_counts, ep)
    mask1 = mask1 * (loc1 < cap)
    mask2 = mask2 * (loc2 < cap)
    g1, g2 = (gates * mask1).sum(dim=1), (gates * mask2).sum(dim=1)
    denom = torch.clamp(g1 + g2, min=torch.finfo(gates.dtype).eps)
    g1, g2 = g1 / denom, g2 / denom
    experts = torch.stack([idx1, idx2])
    slots = torch.stack([(loc1 * mask1).sum(dim=1), (loc2 * mask2).sum(dim=1)])
    kept = torch.stack([mask1.sum(dim=1) > 0, mask2.sum(dim=1) > 0])
    return Routing(experts, slots, torch.stack([g1, g2]), kept, cap, e, l_aux, exp_counts)


def topkgating(logits: torch.Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep: Comm | None = None, normalize: bool = True, sp: Comm | None = None) -> Routing:
    """Top-k routing of ``logits`` [S, E] for any k (see the module docstring)."""
    gates = F.softmax(logits.float(), dim=1)
    s, e = gates.shape
    top = torch.topk(gates, k, dim=1).indices.t()  # [k, S], most probable first
    masks = [F.one_hot(top[j], e).to(torch.long) for j in range(k)]
    counts = torch.stack(masks).sum(dim=(0, 1))
    l_aux = sequence_aux(torch.sum(gates.mean(dim=0) * _frac(counts.float() / s, sp)) * e / k, sp)
    exp_counts = counts.detach().cpu()
    cap = capacity(s, e, capacity_factor, min_capacity, k=k) if drop_tokens else _max_count(exp_counts, ep)
    before = torch.zeros(1, e, dtype=torch.long, device=logits.device)  # earlier choices of each expert
    slots, kept, weights = [], [], []
    for mask in masks:
        loc = _slots(mask) + before
        before = before + mask.sum(dim=0, keepdim=True)
        mask = mask * (loc < cap)
        slots.append((loc * mask).sum(dim=1))
        kept.append(mask.sum(dim=1) > 0)
        weights.append((gates * mask).sum(dim=1))
    w = torch.stack(weights)
    if normalize:
        w = w / torch.clamp(w.sum(dim=0, keepdim=True), min=torch.finfo(w.dtype).eps)
    return Routing(top, torch.stack(slots), w, torch.stack(kept), cap, e, l_aux, exp_counts)


class TopKGate(torch.nn.Module):
    """The router: ``wg`` (Linear hidden → experts, no bias, fp32) and the gating rule.
    ``forward(x [S, d])`` returns a :class:`Routing`. The noisy policies act in training
    only (``Jitter`` on the router input, ``RSample`` on top-1 selection). ``k`` > 2, or
    ``norm_topk_prob`` set (True / False: renormalise the k weights or not), routes by
    :func:`topkgating`; None keeps DeepSpeed's top-1 / top-2 rules."""

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts: bool = True, top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if not 1 <= k <= num_experts:
            raise ValueError(f"MoE k={k} must be between 1 and num_experts {num_experts}")
        if noisy_gate_policy not in NOISY_POLICIES:
            raise ValueError(f"MoE noisy_gate_policy {noisy_gate_policy!r} must be one of {NOISY_POLICIES}")
        self.wg = torch.nn.Linear(model_dim, num_experts, bias=False).float()
        self.k, self.capacity_factor, self.eval_capacity_factor = k, capacity_factor, eval_capacity_factor
        self.min_capacity, self.noisy_gate_policy = min_capacity, noisy_gate_policy
        self.drop_tokens, self.use_rts, self.second_expert_sampling = drop_tokens, use_rts, top2_2nd_expert_sampling
        self.ep: Comm | None = None  # bound by the MoE layer (drop_tokens=False all-reduces over it)
        self.sp: Comm | None = None  # sequence parallelism: the aux loss is the whole sequences' (bound by apply_moe)
        self.norm_topk_prob: bool | None = None

    def forward(self, x: torch.Tensor, used_token: torch.Tensor | None = None) -> Routing:
        x = x.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = multiplicative_jitter(x)
        logits = F.linear(x, self.wg.weight.float())
        cf = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k > 2 or self.norm_topk_prob is not None:
            normalize = True if self.norm_topk_prob is None else self.norm_topk_prob
            return topkgating(logits, self.k, cf, self.min_capacity, self.drop_tokens, self.ep, normalize, self.sp)
        if self.k == 1:
            return top1gating(logits, cf, self.min_capacity, used_token,
                              self.noisy_gate_policy if self.training else None, self.drop_tokens, self.use_rts,
                              self.ep, self.sp)
        return top2gating(logits, cf, self.min_capacity, self.drop_tokens, self.ep, self.second_expert_sampling,
                          self.sp)
