"""Moving tokens to expert buffers and back, and the expert-parallel all-to-all.

Two dispatch paths read the same :class:`~zeal.moe.gating.Routing` and give the same
``[E, C, d]`` buffer and the same combined output:

* ``einsum`` (DeepSpeed / GShard): build the ``[S, E, C]`` combine tensor and its 0/1
  dispatch mask, ``buf = einsum("sec,sd->ecd")``, ``out = einsum("sec,ecd->sd")``;
  memory and time grow with S·E·C;
* ``sort`` (what Megablocks and current Megatron do): the kept (token, expert, slot)
  triples are sorted by destination row ``expert·C + slot`` and the tokens copied into
  those rows (an index copy), and combining is a gather of the rows times the gates
  added back per token (an index add); no ``[S, E, C]`` tensor exists.

:class:`AllToAll` is the autograd pair: the forward sends chunk j of dim 0 to ep rank j,
the backward sends the gradient back the same way (two per MoE layer each way).
"""

from __future__ import annotations

import torch

from zeal.dist.comm import Comm
from zeal.moe.gating import Routing

DISPATCH_MODES = ("einsum", "sort")


def combine_tensor(r: Routing) -> torch.Tensor:
    """The ``[S, E, C]`` combine weights (0 where a token does not go)."""
    k, s = r.experts.shape
    out = torch.zeros(s, r.num_experts, r.capacity, dtype=r.gates.dtype, device=r.gates.device)
    tok = torch.arange(s, device=r.gates.device)
    for j in range(k):
        keep = r.kept[j]
        # accumulate (not assign) so the gates stay differentiable through index_put
        out = out.index_put((tok[keep], r.experts[j][keep], r.slots[j][keep]), r.gates[j][keep], accumulate=True)
    return out


def dispatch_einsum(x: torch.Tensor, r: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [S, d] → (buffer [E, C, d], combine [S, E, C])."""
    combine = combine_tensor(r)
    mask = combine_tensor_mask(r, combine)
    return torch.einsum("sec,sd->ecd", mask.to(x.dtype), x), combine


def combine_tensor_mask(r: Routing, combine: torch.Tensor) -> torch.Tensor:
    """The 0/1 dispatch mask: where a kept choice sits (a kept choice may have gate 0)."""
    k, s = r.experts.shape
    mask = torch.zeros(combine.shape, dtype=torch.bool, device=combine.device)
    tok = torch.arange(s, device=combine.device)
    for j in range(k):
        keep = r.kept[j]
        mask[tok[keep], r.experts[j][keep], r.slots[j][keep]] = True
    return mask


def combine_einsum(y: torch.Tensor, combine: torch.Tensor) -> torch.Tensor:
    """Expert outputs [E, C, d] → tokens [S, d] weighted by the combine tensor."""
    return torch.einsum("sec,ecd->sd", combine.to(y.dtype), y)


def _sorted_rows(r: Routing) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kept choices sorted by destination row: (rows, source tokens, gates), each [N]."""
    k, s = r.experts.shape
    tok = torch.arange(s, device=r.experts.device).expand(k, s)
    keep = r.kept
    rows = (r.experts * r.capacity + r.slots)[keep]
    order = torch.argsort(rows, stable=True)
    return rows[order], tok[keep][order], r.gates[keep][order]


def dispatch_sort(x: torch.Tensor, r: Routing) -> tuple[torch.Tensor, tuple]:
    """``x`` [S, d] → (buffer [E, C, d], what :func:`combine_sort` needs)."""
    rows, src, gates = _sorted_rows(r)
    buf = x.new_zeros(r.num_experts * r.capacity, x.shape[1])
    buf = buf.index_copy(0, rows, x.index_select(0, src))
    return buf.view(r.num_experts, r.capacity, x.shape[1]), (rows, src, gates, x.shape[0])


def combine_sort(y: torch.Tensor, state: tuple) -> torch.Tensor:
    """Expert outputs [E, C, d] → tokens [S, d]: each kept row times its gate, added to its token."""
    rows, src, gates, s = state
    flat = y.reshape(-1, y.shape[-1])
    picked = flat.index_select(0, rows) * gates.to(y.dtype).unsqueeze(1)
    return y.new_zeros(s, y.shape[-1]).index_add(0, src, picked)


class AllToAll(torch.autograd.Function):
    """All-to-all over ``comm`` along dim 0 (equal chunks); its backward is the same
    all-to-all of the gradient. Every rank of the group must call it, tokens or not."""

    @staticmethod
    def forward(ctx, comm: Comm, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.comm = comm
        x = x.contiguous()
        out = torch.empty_like(x)
        comm.all_to_all(out, x, "moe")
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        ctx.comm.all_to_all(out, grad, "moe")
        return None, out


def all_to_all(comm: Comm | None, x: torch.Tensor) -> torch.Tensor:
    """:class:`AllToAll` when ``comm`` spans more than one rank, else ``x``."""
    if comm is None or not comm.active:
        return x
    return AllToAll.apply(comm, x)
