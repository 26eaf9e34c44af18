"""How the tokens of a pass see each other: the attention object every decoder layer is given.

A layer computes its own q, k, v and hands them to ``attention(layer_idx, q, k, v)``;
what happens next is the attention object's business. Two kinds exist:

* :class:`DenseCausalAttention` (here): each sequence of a ``(B, T)`` batch, or the one
  sequence of a flat ``(T,)`` batch, attends causally over itself; nothing is cached.
  Training, evaluation and the reference forward use it.
* :class:`zeal.inference.attention.PagedAttention`: a ragged serving batch reads and
  writes a paged KV cache.

The object also names the *op backend* of the pass (``ops``): None means plain torch
ops (autograd-safe), else the fused CPU kernels of :mod:`zeal.inference.kernels`,
which the layers call for their norms, RoPE and activations when grad is off. The
backend is thus chosen where the pass is set up, never by a second copy of the math.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class Attention(Protocol):
    """``attention(layer_idx, q (..., T, nh, hd), k (..., T, nkv, hd), v, dropout_p=0.0)``
    returns ``(..., T, nh, hd)``; ``ops`` is the fused-op backend (None: torch)."""

    ops: object | None

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 dropout_p: float = 0.0) -> torch.Tensor: ...


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention with nothing cached: q ``(..., T, nh, hd)``, k/v ``(..., T, nkv, hd)``
    -> ``(..., T, nh, hd)``; no leading dim is one sequence. Grouped K/V heads are
    repeated to the query heads (``nh`` a multiple of ``nkv``)."""
    flat = q.dim() == 3
    if flat:  # the kernels want a batch dimension
        q, k, v = q[None], k[None], v[None]
    rep = q.shape[-2] // k.shape[-2]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=-2), v.repeat_interleave(rep, dim=-2)
    # (B, nh, T, hd)
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                       dropout_p=dropout_p)
    y = y.transpose(1, 2)
    return y[0] if flat else y


class DenseCausalAttention:
    """Attention for training and reference forwards (see the module docstring). ``ops``:
    fused CPU kernels to use in a no-grad forward (None: torch ops everywhere)."""

    def __init__(self, ops: object | None = None) -> None:
        self.ops = ops

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 dropout_p: float = 0.0) -> torch.Tensor:
        return dense_causal_attention(q, k, v, dropout_p)


DENSE = DenseCausalAttention()


def fused_ops(attention: Attention) -> object | None:
    """The fused-op backend a layer uses in this pass: the attention's ``ops`` when grad is
    off (the kernels write in place and have no backward), else None (torch ops)."""
    ops = attention.ops
    return None if ops is None or torch.is_grad_enabled() else ops


def residual_stream(x: torch.Tensor, ops: object | None) -> torch.Tensor:
    """The residual stream a serving pass carries: in fp32 under fused ``ops`` for a 16-bit
    model (the norm kernels add each branch into it and normalise it without rounding it
    to 16 bits, which the torch path does after every residual add; the massive activations
    of some rows then keep their low bits), else ``x`` itself."""
    if ops is None or x.dtype not in (torch.bfloat16, torch.float16):
        return x
    return x.float()
