"""``RepeatingLoader`` and ``OnDevice``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from zeal.utils.meta import meta_device


class RepeatingLoader:
    """Iterate ``loader`` forever: when it ends, start it again (a new epoch; a
    ``DistributedSampler``'s ``set_epoch`` is called with the epoch count, as in DeepSpeed)."""

    def __init__(self, loader: Iterable) -> None:
        self.loader = loader
        self.epoch = 0
        self.data_iter = iter(loader)

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.epoch += 1
            sampler = getattr(self.loader, "sampler", None)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self.epoch)
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


class OnDevice:
    """``with OnDevice(dtype=torch.bfloat16, device="meta"):`` — tensors created inside
    are made on ``device`` with floating point ``dtype``; ``enabled=False`` does nothing."""

    def __init__(self, dtype: torch.dtype | None = None, device: str | torch.device = "meta",
                 enabled: bool = True) -> None:
        self.dtype, self.device, self.enabled = dtype, torch.device(device), enabled
        self._old_dtype: torch.dtype | None = None
        self._context: Any = None

    def __enter__(self) -> OnDevice:
        if self.enabled:
            # on meta, the initialisers' random fills are skipped (no values to fill)
            self._context = meta_device() if self.device.type == "meta" else self.device
            self._context.__enter__()
            if self.dtype is not None:
                self._old_dtype = torch.get_default_dtype()
                torch.set_default_dtype(self.dtype)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            if self._old_dtype is not None:
                torch.set_default_dtype(self._old_dtype)
                self._old_dtype = None
            self._context.__exit__(*exc)
            self._context = None
