"""A tiny language model with one MoE layer, for the expert-parallel tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zeal.moe import MoE

VOCAB, DIM, EXPERTS = 29, 8, 4


class TinyMoENet(nn.Module):
    """Embedding → residual MoE MLP (4 experts) → LayerNorm → head; returns the LM loss
    plus ``aux_coef · l_aux``. ``skew`` (top-1) freezes a router whose logits are
    ``(v·h, -v·h, 0, 0)``: every token goes to expert 0 or 1 (ep rank 0), so ep rank 1's
    experts receive none."""

    def __init__(self, ep_size: int = 1, k: int = 2, aux_coef: float = 0.0, skew: bool = False,
                 dispatch: str = "einsum") -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        expert = nn.Sequential(nn.Linear(DIM, 16), nn.GELU(), nn.Linear(16, DIM))
        self.moe = MoE(DIM, expert, EXPERTS, ep_size=ep_size, k=k, drop_tokens=False, use_rts=False,
                       top2_2nd_expert_sampling=False, dispatch=dispatch)
        for g, e in self.moe.deepspeed_moe.experts.deepspeed_experts.items():
            # experts start different (DeepSpeed's copies start equal), by global index, so a
            # layer built after init_process_group (this rank's experts only) gets the same
            gen = torch.Generator().manual_seed(100 + int(g))
            with torch.no_grad():
                for p in e.parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=gen))
        if skew:
            w = self.moe.deepspeed_moe.gate.wg.weight
            with torch.no_grad():
                w[1] = -w[0]
                w[2:] = 0.0
            w.requires_grad_(False)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.aux_coef = aux_coef

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        out, l_aux, _ = self.moe(h)
        logits = self.head(self.norm(h + out))
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1)) + self.aux_coef * l_aux


def batches(steps: int, world: int, micro: int = 2, seq: int = 8, seed: int = 1) -> list[list[tuple]]:
    """``steps`` global batches, each a list of per-rank (x, y) micro-batches."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (world * micro, seq), generator=g)
        y = torch.randint(0, VOCAB, (world * micro, seq), generator=g)
        out.append([(x[r * micro:(r + 1) * micro], y[r * micro:(r + 1) * micro]) for r in range(world)])
    return out
