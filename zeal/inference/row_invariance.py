"""Single-row projections computed as two-row ones, so that a row's 16-bit products do not
depend on how many rows its pass has.

On CPU, torch's bf16 ``F.linear`` takes a matrix-vector path for one input row and a
matrix-matrix path for two or more, and the two sum the products in different orders:
with SmolLM2-135M's ``down_proj`` (1536 inputs) a row's output differs in its last bits
between a one-row pass and a pass of 2-16 rows (which all agree with each other). Plain
greedy decoding of one request runs one-row passes; speculative verification feeds the
last token and its drafts together, so without this the verified logits differ from the
ones plain decoding computes, and greedy outputs drift apart in bf16. While
:class:`RowInvariantLinears` is active, a one-row input to any ``nn.Linear`` of the model
(the output head excepted: its logits are recomputed in fp32, see ``exact_logits``) is
fed as the row twice and the first output row kept: the weights are read once either way.
"""

from __future__ import annotations

import torch
from torch import nn


class RowInvariantLinears:
    """Forward hooks on ``model``'s linear layers (all but ``exclude``), acting only inside
    ``with self:`` (the serving passes of a 16-bit model on the fused CPU path)."""

    def __init__(self, model: nn.Module, exclude: nn.Module | None = None) -> None:
        self.active = False
        self._padded: nn.Module | None = None
        self._handles = []
        for m in model.modules():
            if isinstance(m, nn.Linear) and m is not exclude:
                self._handles.append(m.register_forward_pre_hook(self._pre))
                self._handles.append(m.register_forward_hook(self._post))

    def __enter__(self) -> RowInvariantLinears:
        self.active = True
        return self

    def __exit__(self, *exc) -> None:
        self.active, self._padded = False, None

    def remove(self) -> None:
        """Detach the hooks from the model."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre(self, module: nn.Module, args: tuple) -> tuple | None:
        x = args[0]
        if not self.active or x.dim() != 2 or x.shape[0] != 1:
            return None
        self._padded = module
        return (x.expand(2, -1).contiguous(), *args[1:])

    def _post(self, module: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor | None:
        if self._padded is not module:
            return None
        self._padded = None
        return out[:1]
