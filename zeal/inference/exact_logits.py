"""The leading logits of a 16-bit model recomputed without their final rounding.

A bf16 projection accumulates in fp32 and rounds each logit once, to 8 significant
bits: at logits near 16 the spacing is 0.125, so the top two tokens often round to the
same value (the argmax then takes the lower id) or trade places. The fused serving path
recomputes each row's ``k`` leading logits as fp32 dot products of the same bf16 hidden
state and weights (``k * hidden`` multiply-adds per row, nothing next to the projection
itself) and returns fp32 logits, so the greedy choice is the one the fp32-accumulated
products make: what an fp32 model would pick, up to the error already in the hidden state.
"""

from __future__ import annotations

import torch
from torch import nn


class HiddenCapture:
    """Records the input of ``lm_head`` during one forward pass (a hook removed on exit)."""

    def __init__(self, lm_head: nn.Module) -> None:
        self.lm_head = lm_head
        self.hidden: torch.Tensor | None = None
        self._handle = None

    def __enter__(self) -> HiddenCapture:
        def hook(_module, args, _out):
            self.hidden = args[0]

        self._handle = self.lm_head.register_forward_hook(hook)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()


def refine_top_logits(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None = None, k: int = 8) -> torch.Tensor:
    """fp32 ``logits (S, V)`` whose ``k`` largest entries per row are recomputed as fp32 dot
    products ``hidden (S, H) . weight[v] (+ bias[v])``; the rest are the given values, upcast."""
    k = min(k, logits.shape[-1])
    top = logits.topk(k, dim=-1).indices  # (S, k)
    w = weight.index_select(0, top.reshape(-1)).view(*top.shape, -1).float()  # (S, k, H)
    # an elementwise product summed per row: each row's sum is taken the same way whatever the
    # number of rows (a batched matmul may pick its kernel by the batch's shape)
    exact = (w * hidden.float().unsqueeze(1)).sum(-1)  # (S, k)
    if bias is not None:
        exact += bias.float()[top]
    return logits.float().scatter_(-1, top, exact)
