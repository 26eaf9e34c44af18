"""Small test models that exercise every corner of the partitioning."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM = 37, 12


class TinyNet(nn.Module):
    """Tied embedding/head, a frozen layer, a buffer, and sizes not divisible by 2 or 4
    (the embedding has 444 = 4·111 elements, l1 has 12·13 + 13 = 169)."""

    def __init__(self, tied: bool = True, frozen: bool = True, blocks: int = 0) -> None:
        super().__init__()
        # a ModuleList of small repeated blocks: stage 3 makes each block one unit
        self.blocks = nn.ModuleList(_Block() for _ in range(blocks)) if blocks else None
        self.emb = nn.Embedding(VOCAB, DIM)
        self.frozen = nn.Linear(DIM, DIM) if frozen else None
        if frozen:
            self.frozen.requires_grad_(False)
        self.l1 = nn.Linear(DIM, 13)
        self.l2 = nn.Linear(13, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        self.register_buffer("gain", torch.full((DIM,), 0.75))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        if self.frozen is not None:
            h = torch.tanh(self.frozen(h))
        h = h + self.l2(F.gelu(self.l1(h))) * self.gain
        for block in self.blocks or ():
            h = block(h)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 7)
        self.down = nn.Linear(7, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.tanh(self.up(self.norm(h))))


def make_batches(steps: int, accum: int, world: int, micro: int, seq: int = 6, seed: int = 7):
    """[step][micro][rank] -> (x, y) int64 tensors, deterministic."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        per_micro = []
        for _ in range(accum):
            per_micro.append([(torch.randint(0, VOCAB, (micro, seq), generator=g),
                               torch.randint(0, VOCAB, (micro, seq), generator=g)) for _ in range(world)])
        out.append(per_micro)
    return out
