"""The tiled logits loss of the usual head: a bias-free ``nn.Linear`` scored by ``F.cross_entropy``.

:func:`zeal.models.tiled.tiled_logits_loss` takes this path when its projection is such a head
whose weight is the one parameter trained. The forward is the generic one (each tile's logits,
their fp32 copy, ``F.cross_entropy``), and also keeps each row's log-sum-exp (4 bytes a row). The
backward then needs no whole-size sum of the weight's gradient over the tiles:

* :func:`backward_by_slices` (the weight readable: not ZeRO-3, or ZeRO-3 holding it for the
  call; and no more rows than the vocabulary has, :func:`by_slices`): the vocabulary is the outer loop. For each slice of vocabulary rows (about 2²⁰
  weight elements) and each row tile, the block of logits is recomputed, turned into its
  gradient ``grad · (exp(z − lse) − onehot)`` in place, and both products are taken at once:
  the slice's weight gradient (summed over the tiles in fp32, a slice at a time, then written
  into the weight-sized result) and the input's (summed over the slices in fp32, one value per
  input element). Held beside the weight: its gradient in the weight's dtype, the input's in
  fp32, one slice and one block. The same logits are computed once, as in the per-tile order.
* :func:`tile_backward` (otherwise: more rows than vocabulary, or ZeRO-3 without a holder):
  tile by tile through the head module (its hooks gather the weight), with an fp32 sum of the
  weight's gradient added one slice at a time, and the logits' gradient formed in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Elements per slice of a parameter-sized tensor (a vocabulary slice of the head: rows x hidden).
SLICE_ELEMS = 1 << 20


def vocab_slice(hidden: int) -> int:
    """Vocabulary rows per slice: about ``SLICE_ELEMS`` weight elements."""
    return max(1, SLICE_ELEMS // max(hidden, 1))


def by_slices(w: torch.Tensor, x: torch.Tensor) -> bool:
    """Take :func:`backward_by_slices`: the weight has its storage (a released ZeRO-3 unit's
    views have none) and there are no more rows than vocabulary rows. The slices hold an fp32
    sum of the input's gradient (4 bytes a row and hidden value), the tiles an fp32 sum of the
    weight's (4 bytes a vocabulary row and hidden value): the smaller one wins."""
    return (w.numel() == 0 or w.untyped_storage().nbytes() > 0) and x.size(0) <= w.size(0)


def forward_tile(head: nn.Linear, xt: torch.Tensor, yt: torch.Tensor, ignore_index: int,
                 lse: torch.Tensor) -> torch.Tensor:
    """One tile's summed cross-entropy (``F.cross_entropy``, as the generic path), writing each
    row's log-sum-exp of the fp32 logits into ``lse``."""
    z = head(xt).float()
    loss = F.cross_entropy(z, yt, ignore_index=ignore_index, reduction="sum")
    torch.logsumexp(z, dim=-1, out=lse)
    return loss


def _block_grad(z: torch.Tensor, lse: torch.Tensor, y: torch.Tensor, counted: torch.Tensor, v0: int,
                grad: torch.Tensor) -> torch.Tensor:
    """``grad · (softmax − onehot)`` of a block of fp32 logits (columns ``v0`` on), in place; 0 on
    rows not counted."""
    p = z.sub_(lse.unsqueeze(1)).exp_().mul_(grad)
    hit = counted & (y >= v0) & (y < v0 + z.size(1))
    idx = hit.nonzero().squeeze(1)
    p[idx, y[idx] - v0] -= grad
    return p.mul_(counted.unsqueeze(1))


def backward_by_slices(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, lse: torch.Tensor, n: int,
                       grad: torch.Tensor, ignore_index: int, need_x: bool,
                       need_w: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(d loss/d x, d loss/d w)`` of ``grad ·`` the summed cross-entropy of ``x @ wᵀ`` (see the
    module docstring); ``lse``: the rows' log-sum-exp from the forward, ``n``: its row tiles."""
    counted = y != ignore_index
    gx = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if need_x else None
    gw = torch.empty_like(w) if need_w else None
    tiles = list(zip(x.tensor_split(n), y.tensor_split(n), lse.tensor_split(n), counted.tensor_split(n),
                     gx.tensor_split(n) if gx is not None else [None] * n))
    step = vocab_slice(w.size(1))
    for v0 in range(0, w.size(0), step):
        wj = w[v0:v0 + step]
        acc = torch.zeros(wj.shape, dtype=torch.float32, device=w.device) if need_w else None
        wj32 = wj.float() if need_x else None
        for xt, yt, lt, ct, gt in tiles:
            p = _block_grad(F.linear(xt, wj).float(), lt, yt, ct, v0, grad)
            if acc is not None:  # the products autograd would take: the logits' gradient in their dtype
                add_product(acc, p.to(wj.dtype).t(), xt)
            if gt is not None:
                gt.addmm_(p, wj32)
        if gw is not None:
            gw[v0:v0 + step] = acc
        del acc, wj32  # before the next slice's
    return (None if gx is None else gx.to(x.dtype)), gw


def tile_backward(head: nn.Linear, ignore_index: int, xt: torch.Tensor, yt: torch.Tensor, grad: torch.Tensor,
                  gx: torch.Tensor | None, acc: list[torch.Tensor | None], start: int) -> int:
    """One tile through the head module: autograd takes the logits' gradient (formed in place,
    :func:`cross_entropy_grad`) back to the input only; the weight's gradient ``dlogitsᵀ · x`` is
    added into the fp32 sum ``acc[0]`` one slice of vocabulary rows at a time. Returns the next row."""
    xt = xt.detach().requires_grad_(gx is not None)
    with torch.set_grad_enabled(gx is not None):
        logits = head(xt)  # (a ZeRO-3 head is gathered for this call and again for the input's gradient)
    dlogits = cross_entropy_grad(logits.detach(), yt, grad, ignore_index)
    if gx is not None:
        (gx[start:start + xt.size(0)],) = torch.autograd.grad(logits, [xt], dlogits)
    del logits
    w = head.weight
    if acc[0] is None:
        acc[0] = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    xd = xt.detach()
    step = vocab_slice(xd.size(-1))
    for v in range(0, w.size(0), step):
        add_product(acc[0][v:v + step], dlogits[:, v:v + step].t(), xd)
    return start + xt.size(0)


def add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b``: in place when the dtypes agree, else through ``a @ b`` in theirs."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    else:
        acc.add_(a @ b)


def cross_entropy_grad(logits: torch.Tensor, y: torch.Tensor, grad: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``grad ·`` the gradient of ``F.cross_entropy(logits.float(), y, reduction="sum")`` with
    respect to ``logits``, in their dtype: ``grad · (softmax − onehot(y))`` on the counted rows,
    0 on ignored ones. One fp32 copy of the logits, turned into the softmax a few rows at a time."""
    p = logits.float()
    rows = max(1, SLICE_ELEMS // max(p.size(-1), 1))
    for r in range(0, p.size(0), rows):
        p[r:r + rows] = torch.softmax(p[r:r + rows], dim=-1)
    p.mul_(grad)
    counted = y != ignore_index
    idx = counted.nonzero().squeeze(1)
    p[idx, y[idx]] -= grad
    p.mul_(counted.unsqueeze(1))
    return p.to(logits.dtype)
