"""Flat buffers kept for reuse, so that per-step work does not allocate afresh
(page faults and zero-fill on every first touch)."""

from __future__ import annotations

import torch


class BufferPool:
    """Free 1-D tensors by (numel, dtype, device); :meth:`take` reuses one or allocates."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        free = self._free.get((numel, dtype, device))
        return free.pop() if free else torch.empty(numel, dtype=dtype, device=device)

    def give(self, t: torch.Tensor) -> None:
        self._free.setdefault((t.numel(), t.dtype, t.device), []).append(t)

    def nbytes(self) -> int:
        """Bytes held by the free buffers."""
        return sum(t.numel() * t.element_size() for free in self._free.values() for t in free)
