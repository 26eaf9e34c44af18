"""Linear layers of a served fp32 or bf16 model run on weights re-laid out once for oneDNN.

``F.linear`` hands PyTorch's CPU GEMM a plain row-major weight at every call; oneDNN's
``_linear_pointwise`` on a weight reordered once into its blocked layout skips that
per-call packing: on this project's 2-core machine, one thread, the decode shapes of
SmolLM2-135M run 1.25-1.55x faster in fp32 and its 49152-row vocabulary head 2.2x (vLLM's
CPU build gets its fp32 lead over plain torch the same way); in bf16 1.15-1.4x, with
results bitwise equal to ``F.linear``'s. The reordered product is also invariant to the
number of rows (a row's output is bitwise the same in a one-row pass and in a 300-row
one), which speculative decoding's verify passes rely on.

:class:`PackedLinears` keeps the model untouched outside a pass: :meth:`active` points
each ``nn.Linear``'s ``forward`` at the packed product for the duration of one pass and
restores it after, so a module shared with a trainer still trains through ``F.linear``.
A weight changed in place (``load_weights``, an optimizer step on a shared module) is
noticed by its version counter and storage address and re-packed on its next use.

Used only where it is exact to assume the weights are plain resident tensors: CPU, fp32 or bf16,
oneDNN present, no forward pre-hooks anywhere in the model (ZeRO-3's gathers, streamed
layers), and ``ZEAL_CPU_PACKED_LINEAR`` not ``0``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["PackedLinears", "packed_linears_for"]

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def packed_linears_for(model: nn.Module, device: torch.device, dtype: torch.dtype) -> PackedLinears | None:
    """A :class:`PackedLinears` for ``model``, or None where the plain path must stay
    (not CPU fp32/bf16, no oneDNN, hooks that move weights, or ``ZEAL_CPU_PACKED_LINEAR=0``)."""
    if device.type != "cpu" or dtype not in PACKED_DTYPES or os.environ.get("ZEAL_CPU_PACKED_LINEAR", "1") == "0":
        return None
    if not _onednn_available() or getattr(model, "weight_streamer", None) is not None:
        return None
    if any(m._forward_pre_hooks or m._forward_hooks for m in model.modules()):
        return None
    packed = PackedLinears(model, dtype)
    if not packed.linears:
        return None
    packed.pack_all()  # at start-up, as a server would, rather than inside the first passes
    return packed


class PackedLinears:
    """The plain ``nn.Linear`` layers of ``model`` with their reordered weights: a subclass
    with its own ``forward`` (fake quantization, LoRA) or a layer whose ``forward`` was
    replaced (tensor parallelism's row-parallel layers) keeps its own."""

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype
        self.linears = [m for m in model.modules() if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward
                        and "forward" not in m.__dict__ and m.weight.dtype == dtype]
        self._forwards = {m: self._forward_of(m) for m in self.linears}
        self._cache: dict[nn.Linear, tuple[tuple[int, int], torch.Tensor]] = {}

    def _packed(self, m: nn.Linear) -> torch.Tensor:
        w = m.weight
        stamp = (w._version, w.data_ptr())
        hit = self._cache.get(m)
        if hit is None or hit[0] != stamp:
            hit = (stamp, torch.ops.mkldnn._reorder_linear_weight(w.detach()))
            self._cache[m] = hit
        return hit[1]

    def _forward_of(self, m: nn.Linear):
        def forward(x: torch.Tensor) -> torch.Tensor:
            if x.dtype != self.dtype or torch.is_grad_enabled():
                return nn.Linear.forward(m, x)
            return torch.ops.mkldnn._linear_pointwise(x, self._packed(m), m.bias, "none", [], "")
        return forward

    @contextmanager
    def active(self) -> Iterator[None]:
        """Within: the layers compute with their packed weights."""
        for m, f in self._forwards.items():
            m.forward = f
        try:
            yield
        finally:
            for m in self._forwards:
                m.__dict__.pop("forward", None)

    def pack_all(self) -> None:
        """Reorder every layer's weight now (otherwise each is reordered on first use)."""
        with torch.no_grad():
            for m in self.linears:
                self._packed(m)

    def drop(self) -> None:
        """Free the packed copies (the engine's ``sleep``); they are rebuilt on next use."""
        self._cache.clear()

    @property
    def nbytes(self) -> int:
        """Bytes held by the packed copies."""
        return sum(t.numel() * t.element_size() for _, t in self._cache.values())
