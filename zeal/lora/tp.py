"""LoRA under tensor parallelism: adapters split consistently with their base linear.

A column-parallel base ``W (out/T, in)`` keeps ``B``'s rows of its output slice
(``B (out/T, r)``) and the whole ``A (r, in)``; a row-parallel base ``W (out, in/T)``
keeps ``A``'s columns of its input slice (``A (r, in/T)``) and the whole ``B``. The
low-rank activation ``u = A x (..., r)`` is then combined over tp:

* row: each rank holds a partial ``A_t x_t``; ``u`` is their all-reduce (forward),
  identity in backward, so ``B``'s gradient is the same on every rank;
* column: ``x`` and ``A`` are replicated, but ``u``'s gradient is a partial sum
  ``B_t^T g_t``; it is all-reduced in backward (``copy_to_tp``), which gives ``A`` its
  full gradient on every rank. ``x``'s share of it is scaled by ``1/T`` because the
  pair's own input all-reduce sums ``x``'s gradient over the T ranks again.

One extra all-reduce of ``(tokens, r)`` per adapted linear and direction; the
replicated factor gets identical gradients on every tp rank, as replicated norms do.
"""

from __future__ import annotations

import torch
from torch import nn

from zeal.lora.apply import LoraState
from zeal.lora.layer import lora_a_tp as lora_a_tp  # the layer's tp forward (it lives with the layer)
from zeal.parallel.tensor import Split, TensorParallel

__all__ = ["lora_a_tp", "split_lora_for_tp"]


def _slice(p: nn.Parameter, dim: int, like: Split, size: int, rank: int) -> Split:
    """Slice ``p`` along ``dim`` with the same segments as the base weight's split."""
    full = tuple(p.shape)
    segs = like.segments
    parts = len(segs)
    block = full[dim] // parts
    step = block // size
    segs = tuple((j * step, j * block + rank * step, step) for j in range(parts))
    with torch.no_grad():
        pieces = [p.data.narrow(dim, g, n) for _, g, n in segs]
        p.data = (pieces[0] if parts == 1 else torch.cat(pieces, dim)).clone()
    return Split(dim, full, segs)


def split_lora_for_tp(model: nn.Module, state: LoraState, tp: TensorParallel) -> None:
    """After :func:`zeal.parallel.tensor.apply_tensor_parallel`: split each adapter of a
    split base (B by rows for a column base, A by columns for a row base), record the
    splits in ``tp.splits`` (so gathers, checkpoints and the gradient norm treat them as
    split) and route the forward through the adapter-aware path. Adapters on unsplit
    linears (the head) stay whole."""
    names = {id(p): n for n, p in model.named_parameters()}
    for path, mod in state.modules.items():
        if mod.weight is None:
            raise ValueError(f"lora.quantize_base with tensor parallelism is not supported ({path})")
        base = tp.splits.get(names[id(mod.weight)])
        if base is None:
            continue
        if not isinstance(mod.lora_dropout, nn.Identity):
            raise ValueError(f"lora.dropout > 0 with tensor parallelism is not supported ({path}): set dropout 0")
        if base.dim == 0:  # column: out split
            sp = _slice(mod.lora_B.weight, 0, base, tp.size, tp.rank)
            tp.splits[f"{path}.lora_B.weight"] = sp
            mod.tp_mode = "column"
        else:  # row: in split
            sp = _slice(mod.lora_A.weight, 1, base, tp.size, tp.rank)
            tp.splits[f"{path}.lora_A.weight"] = sp
            mod.tp_mode = "row"
            mod.__dict__.pop("forward", None)  # TP's row forward ignores the adapter; ours reduces itself
        mod.out_features, mod.in_features = mod.weight.shape
        mod.tp_comm = tp.comm
