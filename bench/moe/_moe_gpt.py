"""The MoE GPT both sides of ``bench_moe_peer.py`` train: plain PyTorch with the MoE layer
class passed in, so the same file runs in zeal's environment (``zeal.moe.MoE``) and in
DeepSpeed's (``deepspeed.moe.layer.MoE``) — the port-by-changing-the-import claim.

Also a byte counter over ``torch.distributed``'s collectives and point-to-point sends,
installed the same way on both sides: per op, the bytes that leave the rank under the
bandwidth-optimal algorithm (an all-reduce of B bytes on n ranks sends 2B(n-1)/n); a call
over a group of one rank sends nothing.
Imports only torch (and the MoE class the caller gives).
"""

from __future__ import annotations

import collections
import functools
import time

import torch
import torch.nn.functional as F
from torch import nn

# ~60M parameters in all with 8 experts, ~15M active per token (top-2)
VOCAB, DIM, HEADS, LAYERS, FFN, EXPERTS, TOP_K, SEQ = 256, 512, 8, 4, 1792, 8, 2, 128


class Block(nn.Module):
    """Pre-norm attention + an MoE MLP of GELU experts; returns (h, l_aux)."""

    def __init__(self, moe_cls, ep_size: int, capacity_factor: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        expert = nn.Sequential(nn.Linear(DIM, FFN), nn.GELU(), nn.Linear(FFN, DIM))
        self.moe = moe_cls(DIM, expert, EXPERTS, ep_size=ep_size, k=TOP_K, capacity_factor=capacity_factor,
                           eval_capacity_factor=capacity_factor, min_capacity=4, drop_tokens=True, use_rts=True,
                           top2_2nd_expert_sampling=True)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, _ = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(b, s, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, DIM)
        h = h + self.proj(a)
        out, l_aux, _ = self.moe(self.ln2(h))
        return h + out, l_aux


class MoEGPT(nn.Module):
    """Byte-level GPT; ``forward(ids)`` returns LM loss + 0.01 · Σ l_aux."""

    def __init__(self, moe_cls, ep_size: int, capacity_factor: float = 1.0) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(Block(moe_cls, ep_size, capacity_factor) for _ in range(LAYERS))
        self.ln, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids[:, :-1]) + self.pos.weight[: ids.shape[1] - 1]
        aux = h.new_zeros(())
        for blk in self.blocks:
            h, l_aux = blk(h)
            aux = aux + l_aux
        logits = self.head(self.ln(h))
        return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1)) + 0.01 * aux


def batch(rank: int, micro: int, step: int) -> torch.Tensor:
    """Rank ``rank``'s micro-batch of step ``step`` (same ids on both sides)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (micro, SEQ), generator=g)


def timed_steps(engine, rank: int, micro: int, steps: int) -> dict:
    """Train ``steps`` steps of a DeepSpeed-shaped engine (``engine(x)``, ``backward``, ``step``)
    with the byte counter on: per-step seconds and bytes, bytes by op, the last loss."""
    counts = install_byte_counter()
    times, per_step = [], []
    for step in range(steps):
        before = sum(counts.values())
        t0 = time.perf_counter()
        loss = engine(batch(rank, micro, step))
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        per_step.append(sum(counts.values()) - before)
    return {"rank": rank, "times": times, "bytes": per_step, "by_op": dict(counts), "loss": float(loss.detach())}


# op → (position of the tensor this rank sends, bytes leaving the rank per byte of it on n ranks)
COUNTED = {
    "all_reduce": (0, lambda n: 2 * (n - 1) / n),  # ring: reduce-scatter then all-gather
    "broadcast": (0, lambda n: (n - 1) / n),
    "all_to_all_single": (1, lambda n: (n - 1) / n),  # the chunk addressed to itself stays
    "all_to_all": (1, lambda n: (n - 1) / n),
    "all_gather_into_tensor": (1, lambda n: (n - 1)),  # its shard to each other rank
    "all_gather": (1, lambda n: (n - 1)),
    "reduce_scatter_tensor": (1, lambda n: (n - 1) / n),
    "reduce_scatter": (1, lambda n: (n - 1) / n),
    "isend": (0, lambda n: 1.0),
    "send": (0, lambda n: 1.0),
}
KWARG_NAMES = ("tensor", "input", "input_tensor", "input_list", "input_tensor_list")


def install_byte_counter() -> collections.Counter:
    """Wrap ``torch.distributed``'s collectives and sends; the returned Counter maps op → bytes
    leaving this rank (bandwidth-optimal algorithms, the convention of ``Comm``'s accounting)."""
    import torch.distributed as dist

    counts: collections.Counter = collections.Counter()

    def wrap(name, fn):
        pos, share = COUNTED[name]

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            t = args[pos] if len(args) > pos else next((kwargs[k] for k in KWARG_NAMES if k in kwargs), None)
            group = kwargs.get("group")
            if group is None:
                group = next((x for x in args if isinstance(x, dist.ProcessGroup)), None)
            n = dist.get_world_size(group)
            if isinstance(t, (list, tuple)):
                nbytes = sum(x.nbytes for x in t if torch.is_tensor(x))
            else:
                nbytes = t.nbytes if torch.is_tensor(t) else 0
            if n > 1:
                counts[name] += int(nbytes * share(n))
            return fn(*args, **kwargs)
        return counted

    for name in COUNTED:
        if hasattr(dist, name):
            setattr(dist, name, wrap(name, getattr(dist, name)))
    return counts
