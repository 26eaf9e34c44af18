"""``zeal.moe.MoE``: DeepSpeed's mixture-of-experts layer, with expert parallelism.

Forward of one layer over ``x [..., d]`` flattened to S tokens (shapes per rank):

    gate → Routing → dispatch → [E, C, d] ─all-to-all(ep)→ [ep, E_local, C, d]
         → local experts → [ep, E_local, C, d] ─all-to-all(ep)→ [E, C, d] → combine → [S, d]

Experts are named by their GLOBAL index: this rank's experts are
``deepspeed_moe.experts.deepspeed_experts.<g>`` for ``g`` in
``[ep_rank · E_local, (ep_rank + 1) · E_local)``, so a single-process state dict loads
into any ep rank with ``strict=False``. Expert parameters carry DeepSpeed's markers
(``allreduce = False``, ``group_name = "ep_size_<n>"``), which :mod:`zeal.moe.zero` turns
into the CommGroup ZeRO reduces their gradients over (the expert-data group only).

The layer holds all E experts until it is bound to an ep group (:meth:`MoE.bind`, done
by ``zeal.initialize`` through :func:`zeal.moe.apply_moe`, with the mesh's ep group);
built after ``torch.distributed.init_process_group`` it keeps only this rank's experts at
once. The layer never builds a process group itself: an ep layer that was not bound
refuses to run.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from zeal.dist.comm import Comm
from zeal.moe.dispatch import (
    DISPATCH_MODES,
    all_to_all,
    combine_einsum,
    combine_sort,
    dispatch_einsum,
    dispatch_sort,
)
from zeal.moe.gating import TopKGate
from zeal.moe.mappings import drop_tokens, gather_tokens, padded_capacity
from zeal.moe.recompute import exchange


def is_expert_param(p: nn.Parameter) -> bool:
    """Whether ``p`` belongs to an expert (DeepSpeed's marker ``allreduce = False``)."""
    return getattr(p, "allreduce", True) is False


class Experts(nn.Module):
    """This rank's experts, keyed by global index; ``forward([ep, E_local, C, d])`` runs
    expert i on ``[:, i]``."""

    def __init__(self, expert: nn.Module, num_experts: int, ep_size: int) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleDict({str(g): copy.deepcopy(expert) for g in range(num_experts)})
        self.num_experts, self.ep_size = num_experts, ep_size
        # an expert's shape on the meta device, for apply_global once other ranks' experts are gone; taken
        # here, from the plain expert (later, tensor-parallel wrappers hold process groups that do not copy)
        self.template: list[nn.Module] = [copy.deepcopy(expert).to("meta")]  # (a plain list: not a submodule)
        for p in self.parameters():
            p.allreduce = False
            p.group_name = f"ep_size_{ep_size}"

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    def keep_rank(self, ep_rank: int) -> list[nn.Parameter]:
        """Drop every expert but ``ep_rank``'s; returns the dropped parameters."""
        lo = ep_rank * self.num_local_experts
        mine = {str(g) for g in range(lo, lo + self.num_local_experts)}
        dropped = []
        for key in list(self.deepspeed_experts.keys()):
            if key not in mine:
                dropped += list(self.deepspeed_experts[key].parameters())
                del self.deepspeed_experts[key]
        return dropped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for i, expert in enumerate(self.deepspeed_experts.values()):
            y = expert(x[:, i])
            outs.append(y[0] if isinstance(y, tuple) else y)
        return torch.stack(outs, dim=1)


def apply_global(module: nn.Module, fn) -> None:
    """``module.apply(fn)`` as if every MoE layer still held all its experts: where an
    :class:`Experts` keeps only this rank's (built after ``init_process_group``), ``fn``
    also runs, in its place in global expert order, on a throw-away copy of each absent
    expert. A model's weight init through it draws the random numbers one process draws,
    so every expert and every later module start as they do there."""
    for child in module.children():
        if isinstance(child, Experts) and child.template:
            for g in range(child.num_experts):
                have = child.deepspeed_experts[str(g)] if str(g) in child.deepspeed_experts else None
                if have is None:
                    have = copy.deepcopy(child.template[0]).to_empty(device="cpu")
                apply_global(have, fn)
            fn(child.deepspeed_experts)
            fn(child)
        else:
            apply_global(child, fn)
    fn(module)


class MOELayer(nn.Module):
    """Gate, dispatch, all-to-all, experts, all-to-all, combine (DeepSpeed's ``MOELayer``)."""

    def __init__(self, gate: TopKGate, experts: Experts, ep_size: int, dispatch: str = "einsum") -> None:
        super().__init__()
        if dispatch not in DISPATCH_MODES:
            raise ValueError(f"MoE dispatch {dispatch!r} must be one of {DISPATCH_MODES}")
        self.gate, self.experts = gate, experts
        self.ep_size, self.dispatch = ep_size, dispatch
        self.ep: Comm | None = None
        self.bound = ep_size == 1
        self.l_aux: torch.Tensor | None = None
        self.exp_counts: torch.Tensor | None = None
        self.gate_capacity = 0  # the last forward's capacity C
        # tensor parallelism (zeal.moe.tensor, bound by apply_tensor_parallel): the tp group
        # the tokens are replicated over, and duplicate-token dropping around the all-to-alls
        self.tp: Comm | None = None
        self.tp_rank = 0
        self.drop_duplicates = True

    def forward(self, x: torch.Tensor, used_token: torch.Tensor | None = None) -> torch.Tensor:
        d = x.shape[-1]
        flat = x.reshape(-1, d)
        r = self.gate(flat, used_token)
        self.l_aux, self.exp_counts, self.gate_capacity = r.l_aux, r.exp_counts, r.capacity
        if self.dispatch == "sort":
            buf, state = dispatch_sort(flat, r)
        else:
            buf, state = dispatch_einsum(flat, r)
        e, c = r.num_experts, r.capacity
        buf = self._exchange(buf)  # [E, C, d] → [ep, E_local, C, d] from every source rank
        y = self.experts(buf.view(self.ep_size, e // self.ep_size, c, d))
        y = self._exchange(y.reshape(e, c, d))  # back to the ranks the tokens came from
        out = combine_sort(y, state) if self.dispatch == "sort" else combine_einsum(y, state)
        return out.reshape(x.shape).to(x.dtype)

    def _exchange(self, buf: torch.Tensor) -> torch.Tensor:
        """The ep all-to-all of ``buf`` [E, C, d]. Under tensor parallelism with
        duplicate-token dropping each tp rank sends its 1/T of the capacity rows (padded
        to a multiple of T) and the slices are gathered over tp after (zeal.moe.tensor)."""
        tp = self.tp
        if tp is None or not tp.active or not self.drop_duplicates or self.ep is None or not self.ep.active:
            return exchange(self.ep, buf, all_to_all)
        c = buf.shape[1]
        cp = padded_capacity(c, tp.size)
        if cp != c:
            buf = F.pad(buf, (0, 0, 0, cp - c))
        out = gather_tokens(exchange(self.ep, drop_tokens(buf, tp, self.tp_rank), all_to_all), tp, self.tp_rank)
        return out[:, :c] if cp != c else out


class MoE(nn.Module):
    """DeepSpeed's ``deepspeed.moe.layer.MoE``: ``output, l_aux, exp_counts = moe(x)``.

    ``expert`` is copied ``num_experts`` times (DeepSpeed's deep copy, so experts start
    equal). ``k`` ∈ {1, 2}; ``capacity_factor`` (training) and ``eval_capacity_factor``
    scale the per-expert capacity, at least ``min_capacity``; ``drop_tokens=False``
    drops nothing (capacity = the largest expert count over the ep group); ``use_rts``:
    random token selection when an expert overflows (top-1); ``noisy_gate_policy``:
    None, ``"Jitter"`` or ``"RSample"``; ``use_residual``: PR-MoE, a dense copy of the
    expert mixed with the MoE output by a learned softmax coefficient
    (``Linear(hidden, 2)``); ``dispatch``: ``"einsum"`` (the [E, C, d] one-hot,
    DeepSpeed's) or ``"sort"`` (index copies), same results.

    Under ``"tensor_parallel": {"autotp_size": T}`` every expert is split over tp like an
    MLP and the router stays whole (:mod:`zeal.moe.tensor`);
    ``enable_expert_tensor_parallelism`` is accepted for DeepSpeed's signature (zeal
    splits the experts either way: the same results, 1/T of the expert memory).
    """

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, top2_2nd_expert_sampling: bool = True, dispatch: str = "einsum",
                 enable_expert_tensor_parallelism: bool = False) -> None:
        super().__init__()
        if ep_size < 1 or num_experts % ep_size:
            raise ValueError(f"MoE num_experts {num_experts} must be divisible by ep_size {ep_size}")
        self.hidden_size, self.num_experts, self.ep_size = hidden_size, num_experts, ep_size
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, top2_2nd_expert_sampling)
        self.deepspeed_moe = MOELayer(gate, Experts(expert, num_experts, ep_size), ep_size, dispatch)
        if use_residual:
            self.mlp = copy.deepcopy(expert)
            self.coefficient = nn.Linear(hidden_size, 2)
        if ep_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            # built after init_process_group: keep this rank's experts now (ep groups are
            # consecutive data-parallel ranks; the default layout has dp = world)
            self.deepspeed_moe.experts.keep_rank(torch.distributed.get_rank() % ep_size)
            self._sliced_for = torch.distributed.get_rank() % ep_size
        else:
            self._sliced_for: int | None = None

    def bind(self, ep: Comm, ep_rank: int) -> list[nn.Parameter]:
        """Use ``ep`` (``ep_size`` ranks) for the all-to-alls and keep ``ep_rank``'s experts;
        returns the parameters dropped (the other ranks' experts)."""
        if ep.size != self.ep_size:
            raise ValueError(f"MoE layer built with ep_size={self.ep_size} but the mesh's ep group has {ep.size}")
        dropped: list[nn.Parameter] = []
        if self._sliced_for is None:
            dropped = self.deepspeed_moe.experts.keep_rank(ep_rank)
        elif self._sliced_for != ep_rank:
            raise ValueError(f"MoE layer kept the experts of ep rank {self._sliced_for} at construction, but this "
                             f"rank is ep rank {ep_rank} in the mesh; build the model before init_process_group")
        self._sliced_for = ep_rank
        self.deepspeed_moe.ep = self.deepspeed_moe.gate.ep = ep
        self.deepspeed_moe.bound = True
        return dropped

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None):
        """Returns ``(output, l_aux, exp_counts)`` as DeepSpeed's layer does."""
        if not self.deepspeed_moe.bound:  # the groups come from the one mesh, never from here
            raise RuntimeError(f"MoE layer with ep_size={self.ep_size} is not bound to an expert-parallel group: "
                               "train it through zeal.initialize (or deepspeed.initialize), or bind it with "
                               "zeal.moe.apply_moe(model, mesh) where mesh = zeal.dist.build_mesh(ep=...)")
        out = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            dense = dense[0] if isinstance(dense, tuple) else dense
            coef = torch.softmax(self.coefficient(hidden_states), dim=-1)
            out = out * coef[..., 0:1] + dense * coef[..., 1:]
        return out, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
