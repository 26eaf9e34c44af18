"""Small models drawn from the patterns a user's model may have, for stage-3 tests.

``AnyNet(spec)`` is built from a plain dict (so it travels to spawned ranks):

* ``blocks``: how many residual MLP blocks (LayerNorm, Linear D→4D, GELU, Linear 4D→D)
  sit in a ``ModuleList``;
* ``tie``: ``"none"`` (own head), ``"module"`` (the head module shares the embedding's
  weight), ``"outside"`` (the parent computes ``h @ emb.weight.t()`` itself: the
  embedding's weight is read outside the module that owns it);
* ``ckpt``: ``"none"``, ``"reentrant"``, ``"nonreentrant"`` (``torch.utils.checkpoint``
  per block) or ``"sequential"`` (``checkpoint_sequential`` over the blocks);
* ``repeat``: block 0 runs twice in one forward;
* ``shared``: block 1's first Linear shares block 0's weight (one parameter, two modules);
* ``frozen``: index of a block whose parameters do not train (``-1``: none);
* ``branch``: an extra module runs only when the forward is called with
  ``use_extra=True`` (a forward whose module order changes between steps).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

VOCAB, DIM, SEQ = 29, 16, 8


class MLPBlock(nn.Module):
    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h))))


class AnyNet(nn.Module):
    def __init__(self, spec: dict) -> None:
        super().__init__()
        self.spec = dict(spec)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(MLPBlock() for _ in range(spec["blocks"]))
        self.extra = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if spec["tie"] == "module":
            self.head.weight = self.emb.weight
        if spec.get("shared") and spec["blocks"] > 1:
            self.blocks[1].up.weight = self.blocks[0].up.weight
        if spec.get("frozen", -1) >= 0:
            self.blocks[spec["frozen"] % spec["blocks"]].requires_grad_(False)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None, use_extra: bool = False) -> torch.Tensor:
        spec = self.spec
        h = self.emb(x)
        order = [self.blocks[0]] * (2 if spec.get("repeat") else 1) + list(self.blocks[1:])
        if spec["ckpt"] == "sequential" and len(order) > 1:
            h = checkpoint_sequential(order, 2, h, use_reentrant=False)
        else:
            for block in order:
                if spec["ckpt"] in ("reentrant", "nonreentrant"):
                    h = checkpoint(block, h, use_reentrant=spec["ckpt"] == "reentrant")
                else:
                    h = block(h)
        if use_extra:
            h = h + torch.tanh(self.extra(h))
        logits = h @ self.emb.weight.t() if spec["tie"] == "outside" else self.head(h)
        if y is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def batches(steps: int, world: int, micro: int, seed: int = 3) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """[step][rank] -> (x, y), deterministic."""
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randint(0, VOCAB, (micro, SEQ), generator=g), torch.randint(0, VOCAB, (micro, SEQ), generator=g))
             for _ in range(world)] for _ in range(steps)]


def branch_on(step: int, spec: dict) -> bool:
    """Whether step ``step`` runs the extra module (the same on every rank)."""
    return bool(spec.get("branch")) and step % 2 == 0


def reference_losses(spec: dict, steps: int, world: int, micro: int, lr: float) -> list[float]:
    """Plain PyTorch on one process over the concatenated global batch. A trainable
    parameter that got no gradient in a step is updated with a zero gradient, as ZeRO
    does (torch's optimizers would skip it)."""
    torch.manual_seed(0)
    model = AnyNet(spec)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    losses = []
    for step, per_rank in enumerate(batches(steps, world, micro)):
        x = torch.cat([xy[0] for xy in per_rank])
        y = torch.cat([xy[1] for xy in per_rank])
        loss = model(x, y, use_extra=branch_on(step, spec))
        loss.backward()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if spec.get("eval"):
            losses.append(eval_loss(model, world, micro))
    return losses


def eval_loss(model: nn.Module, world: int, micro: int) -> float:
    """Loss on a fixed held-out batch, in eval mode without autograd (then back to training)."""
    x, y = batches(1, 1, micro, seed=11)[0][0]
    model.eval()
    with torch.no_grad():
        loss = model(x, y).item()
    model.train()
    return loss
