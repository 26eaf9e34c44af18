"""Arctic Long Sequence Training's tiling: the MLP and the logits loss over sequence tiles.

Both are custom autograd Functions that run a row-wise computation over ``num_shards``
tiles of the token rows (``tensor_split``: a count that does not divide the rows gives
tiles one row apart) without grad in forward, keep only their input, and in backward
recompute one tile at a time under grad, taking the input's and the parameters'
gradients of that tile with ``torch.autograd.grad``. The parameters are inputs of the
Function, so their gradients are summed over the tiles (in fp32) and handed to autograd
once: a post-accumulate-grad hook (ZeRO's gradient reduction) fires once per call, as
for the untiled module.

* :class:`TiledMLP` (a module wrapping a dense MLP): intermediate activations of one
  tile (rows/num_shards × intermediate) instead of the whole sequence's, for one more
  MLP forward in backward. It registers the wrapped MLP's children as its own, so the
  parameter names (``layers.0.mlp.up_proj.weight``) do not change.
* :func:`tiled_logits_loss`: ``(sum of token losses, counted tokens)`` of a head's
  logits against targets, never holding more than one tile's ``[rows, vocab]`` logits
  in forward or backward. Returning the sum and the count (not their ratio) lets a
  caller that holds only part of the tokens (sequence parallelism) add both over its
  group before dividing.

Row-wise means: row ``i`` of the output depends on row ``i`` of the input only (true of
an MLP and of a projection + cross-entropy; not of attention).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from zeal.models import tiled_head as th

NumShards = int | Literal["auto"]
Hold = Callable[[Sequence[torch.Tensor]], contextlib.AbstractContextManager]

# Elements of one tile's logits under num_shards "auto" for the loss (32 MiB in fp32), as
# zeal's checkpointed chunked loss (zeal.models.checkpointing.LOSS_CHUNK_ELEMS) uses.
LOSS_TILE_ELEMS = 1 << 23


def mlp_shards(num_shards: NumShards, rows: int, hidden: int) -> int:
    """Tiles of an MLP over ``rows`` tokens: ``"auto"`` = ``ceil(rows / hidden)`` (tiles
    about ``hidden`` rows long, as ALST does), an int as given; at most ``rows``, at least 1."""
    n = math.ceil(rows / max(hidden, 1)) if num_shards == "auto" else int(num_shards)
    return max(1, min(n, rows))


def loss_shards(num_shards: NumShards, rows: int, vocab: int) -> int:
    """Tiles of the logits loss: ``"auto"`` = tiles of at most ``LOSS_TILE_ELEMS`` logits."""
    n = math.ceil(rows * vocab / LOSS_TILE_ELEMS) if num_shards == "auto" else int(num_shards)
    return max(1, min(n, rows))


def _grad_params(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [p for p in params if p.requires_grad]


class _TiledRows(torch.autograd.Function):
    """``fn`` over row tiles of ``x`` (rows, d_in) -> (rows, d_out); see the module docstring."""

    @staticmethod
    def forward(ctx, fn: Callable[[torch.Tensor], torch.Tensor], n: int, x: torch.Tensor,  # noqa: D102
                *params: torch.Tensor) -> torch.Tensor:
        ctx.fn, ctx.n = fn, n
        ctx.params = params  # references only: ZeRO-3 re-gathers their storage before backward
        ctx.save_for_backward(x)
        ctx.rng = _rng_state(x)  # a dropout inside fn draws the same masks when backward replays it
        out, start = None, 0
        for xt in x.tensor_split(n):
            y = fn(xt)
            if out is None:
                out = y.new_empty(x.size(0), y.size(-1))
            out[start:start + xt.size(0)] = y
            start += xt.size(0)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # noqa: D102
        (x,) = ctx.saved_tensors
        params = ctx.params
        want = [p.requires_grad for p in params]
        gx = torch.empty_like(x) if ctx.needs_input_grad[2] else None
        acc: list[torch.Tensor | None] = [None] * len(params)
        start = 0
        with _replayed_rng(ctx.rng, x):
            for xt, gt in zip(x.tensor_split(ctx.n), grad_out.tensor_split(ctx.n)):
                start = _tile_backward(ctx.fn, xt, gt, params, want, gx, acc, start)
        return (None, None, gx, *_cast_back(acc, params))


def _tile_backward(fn: Callable, xt: torch.Tensor, gt: torch.Tensor, params: Sequence[torch.Tensor],
                   want: list[bool], gx: torch.Tensor | None, acc: list[torch.Tensor | None], start: int) -> int:
    """Recompute ``fn`` on one tile under grad and add its gradients in; returns the next row."""
    xt = xt.detach().requires_grad_(gx is not None)
    with torch.enable_grad():
        y = fn(xt)
    inputs = ([xt] if gx is not None else []) + [p for p, w in zip(params, want) if w]
    grads = list(torch.autograd.grad(y, inputs, gt, allow_unused=True))
    if gx is not None:
        gx[start:start + xt.size(0)] = grads.pop(0)
    _accumulate(acc, want, grads)
    return start + xt.size(0)


def _rng_state(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(x.device) if x.is_cuda else None


@contextlib.contextmanager
def _replayed_rng(state: tuple[torch.Tensor, torch.Tensor | None], x: torch.Tensor) -> Iterator[None]:
    """The RNG as the forward found it, inside; the caller's RNG untouched outside."""
    cpu, dev = state
    with torch.random.fork_rng(devices=[x.device] if x.is_cuda else [], device_type="cuda"):
        torch.set_rng_state(cpu)
        if dev is not None:
            torch.cuda.set_rng_state(dev, x.device)
        yield


def _accumulate(acc: list[torch.Tensor | None], want: list[bool], grads: list[torch.Tensor | None]) -> None:
    """Add one tile's parameter gradients into the fp32 running sums (16-bit parameters
    would otherwise round the sum at every tile, which the untiled matmul does not)."""
    it = iter(grads)
    for i, w in enumerate(want):
        if not w:
            continue
        g = next(it)
        if g is None:
            continue
        if acc[i] is None:
            acc[i] = g.float() if g.dtype != torch.float32 else g.clone()
        else:
            add_into(acc[i], g)


# Elements per slice when a 16-bit tensor is added into an fp32 one: ``fp32.add_(bf16)`` first
# makes a whole fp32 copy of its operand (a vocabulary x hidden head: 94 MiB at 32000 x 768).
ADD_SLICE_ELEMS = th.SLICE_ELEMS


def add_into(acc: torch.Tensor, g: torch.Tensor) -> None:
    """``acc += g`` in ``acc``'s dtype; a ``g`` of another dtype is converted one slice of
    ``ADD_SLICE_ELEMS`` at a time (the same sums, without a full-size converted copy)."""
    if g.dtype == acc.dtype or acc.numel() <= ADD_SLICE_ELEMS or not acc.is_contiguous():
        acc.add_(g)
        return
    a, b = acc.view(-1), g.reshape(-1)
    for start in range(0, a.numel(), ADD_SLICE_ELEMS):
        a[start:start + ADD_SLICE_ELEMS].add_(b[start:start + ADD_SLICE_ELEMS])


def _cast_back(acc: list[torch.Tensor | None], params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """The parameters' gradients in their dtype; each fp32 sum is dropped once converted."""
    out: list[torch.Tensor | None] = []
    for i, p in enumerate(params):
        a, acc[i] = acc[i], None
        out.append(None if a is None else a.to(p.dtype))
        del a
    return out


def tiled_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, num_shards: int,
               params: Sequence[torch.Tensor]) -> torch.Tensor:
    """``fn(x)`` for a row-wise ``fn`` over ``x`` (..., d) computed in ``num_shards`` tiles
    of the flattened rows, recomputed tile by tile in backward; ``params``: every
    parameter ``fn`` reads (their gradients come back summed over the tiles)."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.size(-1))
    out = _TiledRows.apply(fn, num_shards, flat, *params)
    return out.view(*lead, out.size(-1))


class TiledMLP(nn.Module):
    """A dense MLP run over sequence tiles in a training forward (grad on, ``training``).

    Invariant: same parameters, same names and the same outputs as the wrapped ``mlp``
    (up to summation order); only the memory of its intermediate activations changes,
    to one tile's. Evaluation and serving (grad off, or called with fused ``ops``) call
    ``mlp`` as it is. The wrapped module is not a child: its children (and direct
    parameters, if any) are registered here under the same names."""

    def __init__(self, mlp: nn.Module, num_shards: NumShards = "auto", hidden: int | None = None) -> None:
        super().__init__()
        if list(mlp.buffers(recurse=False)):
            raise ValueError(f"TiledMLP: {type(mlp).__name__} has buffers of its own; only modules whose state "
                             "is in submodules and parameters can be wrapped")
        object.__setattr__(self, "inner", mlp)  # not registered: the names below stay the MLP's
        for name, child in mlp.named_children():
            self.add_module(name, child)
        for name, p in mlp.named_parameters(recurse=False):
            self.register_parameter(name, p)
        self.num_shards = num_shards
        self.hidden = hidden

    def extra_repr(self) -> str:
        return f"{type(self.inner).__name__}, num_shards={self.num_shards}"

    def forward(self, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        """The wrapped MLP's forward, over tiles when training with grad."""
        if kwargs or any(a is not None for a in args) or not self.training or x.dim() < 2:
            return self.inner(x, *args, **kwargs)  # serving (fused ops), evaluation
        rows = x.numel() // x.size(-1)
        n = mlp_shards(self.num_shards, rows, self.hidden or x.size(-1))
        if n == 1:
            return self.inner(x)
        if not torch.is_grad_enabled():  # a no-grad training pass (reentrant checkpointing's first forward)
            flat = x.reshape(-1, x.size(-1))
            return torch.cat([self.inner(t) for t in flat.tensor_split(n)]).view(*x.shape[:-1], -1)
        return tiled_rows(self.inner, x, n, _grad_params(list(self.parameters())))


def tiled_logits_loss(project: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, targets: torch.Tensor,
                      num_shards: NumShards = "auto", *, params: Sequence[torch.Tensor] = (),
                      cross_entropy: Callable[..., torch.Tensor] = F.cross_entropy, ignore_index: int = -100,
                      vocab: int | None = None, hold: Hold | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_sum, count)``: the summed fp32 cross-entropy of ``project(h)`` against
    ``targets`` and the number of targets that are not ``ignore_index``.

    ``h`` (..., d) and ``targets`` (...) hold the same rows (shift labels before calling
    for next-token prediction). ``project`` maps rows to logits (a head; under
    vocabulary-parallel TP this rank's slice, with ``cross_entropy`` the vocab-parallel
    one); ``params``: the parameters ``project`` reads. The logits exist one tile at a
    time, in forward and in backward. The mean is ``loss_sum / count.clamp(min=1)``;
    under sequence parallelism sum both over the sp group first (exact normalisation by
    the global token count). ``count`` carries no gradient. ``hold(params)``: a context
    under which ``params`` stay readable (ZeRO-3 gathers them once for the tile loop, in
    forward and in backward, instead of around every tile's call of ``project``)."""
    rows = h.reshape(-1, h.size(-1))
    ys = targets.reshape(-1)
    if ys.size(0) != rows.size(0):
        raise ValueError(f"tiled_logits_loss: {rows.size(0)} rows of h but {ys.size(0)} targets")
    count = (ys != ignore_index).sum()
    v = vocab or _out_features(project, rows)
    n = loss_shards(num_shards, rows.size(0), v)

    def score(logits: torch.Tensor, yt: torch.Tensor) -> torch.Tensor:
        return cross_entropy(logits.float(), yt, ignore_index=ignore_index, reduction="sum")

    def tile_loss(xt: torch.Tensor, yt: torch.Tensor) -> torch.Tensor:
        return score(project(xt), yt)

    if not torch.is_grad_enabled():
        total = sum(tile_loss(xt, yt) for xt, yt in zip(rows.tensor_split(n), ys.tensor_split(n)))
        return total, count
    params = _grad_params(params)
    plain = cross_entropy is F.cross_entropy and _plain_linear(project, params)
    linear = (project, ignore_index) if plain else None
    return _TiledLoss.apply(tile_loss, linear, hold, n, rows, ys, *params), count


def _plain_linear(project: Callable, params: Sequence[torch.Tensor]) -> bool:
    """``project`` is a bias-free ``nn.Linear`` and its weight is the one parameter trained."""
    return (isinstance(project, nn.Linear) and project.bias is None and len(params) == 1
            and params[0] is project.weight)


def _out_features(project: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor) -> int:
    n = getattr(project, "out_features", None)
    if n:
        return int(n)
    with torch.no_grad():
        return int(project(rows[:1]).size(-1))


def _swap(tile_loss: Callable, yt: torch.Tensor, xt: torch.Tensor) -> torch.Tensor:
    return tile_loss(xt, yt)


class _TiledLoss(torch.autograd.Function):
    """Sum over row tiles of ``tile_loss(x_tile, y_tile)`` (a scalar each); see the module docstring.
    ``linear``: ``(head, ignore_index)`` when the loss is ``F.cross_entropy`` of a bias-free
    ``nn.Linear`` whose weight is the only parameter (:mod:`zeal.models.tiled_head`), else None."""

    @staticmethod
    def forward(ctx, tile_loss: Callable, linear: tuple[nn.Linear, int] | None, hold: Hold | None,  # noqa: D102
                n: int, x: torch.Tensor, y: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.tile_loss, ctx.linear, ctx.hold, ctx.n, ctx.params = tile_loss, linear, hold, n, params
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        lse = torch.empty(x.size(0), dtype=torch.float32, device=x.device) if linear is not None else None
        lse_tiles = lse.tensor_split(n) if lse is not None else [None] * n
        with _held(hold, params):
            for xt, yt, lt in zip(x.tensor_split(n), y.tensor_split(n), lse_tiles):
                if linear is None:
                    total += tile_loss(xt, yt)
                else:
                    total += th.forward_tile(linear[0], xt, yt, linear[1], lt)
        ctx.save_for_backward(x, y, lse)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        x, y, lse = ctx.saved_tensors
        params = ctx.params
        want = [p.requires_grad for p in params]
        need_x = ctx.needs_input_grad[4]
        with _held(ctx.hold, params):
            if ctx.linear is not None and th.by_slices(ctx.linear[0].weight, x):
                gx, gw = th.backward_by_slices(ctx.linear[0].weight, x, y, lse, ctx.n, grad, ctx.linear[1],
                                               need_x, want[0])
                return (None, None, None, None, gx, None, gw)
            gx = torch.empty_like(x) if need_x else None
            acc: list[torch.Tensor | None] = [None] * len(params)
            start = 0
            for xt, yt in zip(x.tensor_split(ctx.n), y.tensor_split(ctx.n)):
                if ctx.linear is not None:
                    start = th.tile_backward(*ctx.linear, xt, yt, grad, gx, acc, start)
                else:
                    start = _tile_backward(functools.partial(_swap, ctx.tile_loss, yt), xt, grad, params, want, gx,
                                           acc, start)
        return (None, None, None, None, gx, None, *_cast_back(acc, params))


def _held(hold: Hold | None, params: Sequence[torch.Tensor]) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if hold is None or not params else hold(params)
