"""Stage-3 parameter shards on disk (``offload_param.device: nvme``), fetched into a bounded pool.

:class:`ParamSwapper` keeps each named parameter shard in a :class:`SwapStore` file and
owns ``buffer_count`` page-aligned buffers of ``buffer_size`` elements. The engine
calls :meth:`prefetch` for the shards its recorded execution order needs next (best
effort: it does nothing when no buffer is free), :meth:`fetch` just before a module
runs (waits for the read; the returned tensor is valid until :meth:`release`), and
:meth:`release` after it (``write_back=True`` when the shard changed, e.g. after the
optimizer step). Never more than ``buffer_count`` buffers exist; a buffer released
with a pending write-back is handed to the next read only after that write completes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import Future

import torch

from zeal.zero.offload.swap import PARAM_PATH_KEY, SwapStore, aligned_empty

BUFFER_COUNT_KEY = "zero_optimization.offload_param.buffer_count"
BUFFER_SIZE_KEY = "zero_optimization.offload_param.buffer_size"


class ParamSwapper:
    """Named parameter shards (``sizes``: name -> numel) on disk, at most ``buffer_count``
    of them in memory at once."""

    def __init__(self, sizes: Mapping[str, int], nvme_path: str | os.PathLike, *, buffer_count: int = 5,
                 buffer_size: int = 10**8, dtype: torch.dtype = torch.float32, direct_io: bool = True,
                 io_parallelism: int = 4) -> None:
        if buffer_count < 1:
            raise ValueError(f"{BUFFER_COUNT_KEY} must be >= 1, got {buffer_count}")
        too_big = {k: n for k, n in sizes.items() if n > buffer_size}
        if too_big:
            name, n = max(too_big.items(), key=lambda kv: kv[1])
            raise ValueError(f"{BUFFER_SIZE_KEY} ({buffer_size} elements) is smaller than parameter shard "
                             f"{name!r} ({n} elements); raise it to at least {n}")
        self.store = SwapStore(nvme_path, sizes, dtype=dtype, direct_io=direct_io,
                               io_parallelism=io_parallelism, config_key=PARAM_PATH_KEY)
        self.buffer_count = buffer_count
        self.buffer_size = min(buffer_size, max(sizes.values(), default=0))
        self._buffers: list[torch.Tensor] = []  # allocated lazily, never more than buffer_count
        self._free: list[tuple[int, Future | None]] = []  # (buffer, write-back still running)
        self._resident: dict[str, tuple[int, Future]] = {}
        self.max_in_use = 0

    @property
    def num_in_use(self) -> int:
        return len(self._resident)

    @property
    def cpu_bytes(self) -> int:
        """Host memory held by the buffers allocated so far (at most ``buffer_count``)."""
        return sum(b.numel() * b.element_size() for b in self._buffers)

    @property
    def disk_bytes(self) -> int:
        return self.store.nbytes

    def is_resident(self, name: str) -> bool:
        return name in self._resident

    def write(self, name: str, src: torch.Tensor) -> None:
        """Store a shard (initial placement or an update of a non-resident shard)."""
        if name in self._resident:
            raise RuntimeError(f"{name!r} is resident; modify the fetched tensor and release(write_back=True)")
        self.store.write(name, src.reshape(-1).contiguous())

    def _acquire(self) -> tuple[int, Future | None] | None:
        if self._free:
            return self._free.pop()
        if len(self._buffers) < self.buffer_count:
            self._buffers.append(aligned_empty(self.buffer_size, self.store.dtype))
            return len(self._buffers) - 1, None
        return None

    def prefetch(self, name: str) -> bool:
        """Start reading ``name`` if it is not resident and a buffer is free; True if it
        is resident (or on its way) afterwards."""
        if name in self._resident:
            return True
        slot = self._acquire()
        if slot is None:
            return False
        index, pending_write = slot
        view = self._buffers[index][:self.store.sizes[name]]
        after = [pending_write] if pending_write is not None else []
        self._resident[name] = (index, self.store.read_async(name, view, 0, after))
        self.max_in_use = max(self.max_in_use, len(self._resident))
        return True

    def fetch(self, name: str) -> torch.Tensor:
        """The shard ``name`` in memory (1-D), reading it now if it was not prefetched."""
        if not self.prefetch(name):
            raise RuntimeError(f"all {self.buffer_count} parameter buffers are in use "
                               f"({sorted(self._resident)[:4]}...); release some or raise {BUFFER_COUNT_KEY}")
        index, future = self._resident[name]
        future.result()
        return self._buffers[index][:self.store.sizes[name]]

    def release(self, name: str, write_back: bool = False) -> None:
        """Give the buffer of ``name`` back; with ``write_back`` its contents are stored first
        (asynchronously: the buffer is reused only after the write completes)."""
        index, future = self._resident.pop(name)
        future.result()
        pending = None
        if write_back:
            pending = self.store.write_async(name, self._buffers[index][:self.store.sizes[name]])
        self._free.append((index, pending))

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> ParamSwapper:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
