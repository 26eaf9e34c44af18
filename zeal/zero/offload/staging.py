"""The device/host boundary of the offload tiers, crossed through explicit staging buffers.

A :class:`Staging` belongs to one compute device and one ``pin_memory`` setting. Every
copy between that device and host memory (gradients down to a CPU optimizer, updated
masters back, stage-3 shards to and from host memory or swap files) goes through it:

* :meth:`Staging.download` / :meth:`Staging.to_host`: device → host buffer. On CUDA the copy
  is issued on a side stream after the compute issued so far, non-blocking when the host
  buffer is pinned; :meth:`Staging.wait_host` is the one host wait before host code reads
  the buffers (several downloads overlap each other and the compute still queued).
* :meth:`Staging.upload` / :meth:`Staging.to_device`: host → device. Issued on the side
  stream, non-blocking when the host side is pinned; the compute stream waits on an event,
  so later kernels see the values and the host does not block.

``crosses`` says whether there is a boundary at all: it is False for a CPU device, where
the tiers keep their host tensors as they are and every method is a plain copy or the
identity. Tests set ``force=True`` (or :data:`FORCE_CROSSING`) to run the crossing path on
a CPU "device": distinct host buffers, every copy counted in :attr:`Staging.stats`.
Pinned host memory is used only when asked (``pin_memory``) and CUDA is present.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zeal.utils.streams import CudaStream, NullStream, current_stream, is_cuda, side_stream

FORCE_CROSSING = False  # tests: treat a CPU device as an accelerator (staging on)


@dataclass
class StagingStats:
    """Copies through the staging buffers, by direction."""

    downloads: int = 0
    uploads: int = 0
    bytes_down: int = 0
    bytes_up: int = 0


class Staging:
    """Copies between ``device`` and host memory; see the module docstring."""

    def __init__(self, device: torch.device | str, pin_memory: bool = False, *, force: bool | None = None,
                 stream: CudaStream | NullStream | None = None) -> None:
        self.device = torch.device(device)
        self.crosses = self.device.type != "cpu" or (FORCE_CROSSING if force is None else force)
        self.pin_requested = bool(pin_memory)
        self.pinned = self.pin_requested and is_cuda(self.device)
        self.stream = stream if stream is not None else side_stream(self.device)
        self.stats = StagingStats()
        self._pending: list = []
        self._buffers: dict[object, torch.Tensor] = {}

    def compute_stream(self) -> CudaStream | NullStream:
        """The stream the device's compute is issued to now."""
        return current_stream(self.device)

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D host tensor (page-locked when pinning is on)."""
        return torch.empty(numel, dtype=dtype, pin_memory=self.pinned)

    def host_buffer(self, key: object, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A reusable host staging buffer named ``key`` (reallocated if the size changes)."""
        buf = self._buffers.get(key)
        if buf is None or buf.numel() != numel or buf.dtype != dtype:
            buf = self._buffers[key] = self.host_empty(numel, dtype)
        return buf

    def download(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst`` (host) gets ``src`` (device); read ``dst`` after :meth:`wait_host`."""
        if not self.crosses:
            dst.copy_(src.reshape(dst.shape))
            return
        self.stream.wait_stream(self.compute_stream())  # src is written by compute issued so far
        with self.stream:
            dst.copy_(src.reshape(dst.shape), non_blocking=self.pinned and dst.is_pinned())
        self.stream.keep(src)
        self._pending.append(self.stream.record_event())
        self.stats.downloads += 1
        self.stats.bytes_down += src.numel() * src.element_size()

    def upload(self, dst: torch.Tensor, src: torch.Tensor, key: object = None) -> None:
        """``dst`` (device) gets ``src`` (host); compute issued after this call sees it. A dtype
        change is made on the host first (into the buffer named ``key``: fewer bytes cross),
        and pageable memory is staged through a pinned buffer when pinning is on."""
        if not self.crosses:
            dst.copy_(src.reshape(dst.shape))
            return
        if src.dtype != dst.dtype and key is not None:
            buf = self.host_buffer(key, src.numel(), dst.dtype)
            buf.copy_(src.reshape(-1))
            src = buf
        elif self.pinned and not src.is_pinned():
            buf = self.host_empty(src.numel(), src.dtype)  # the pinned allocator keeps it until the copy ends
            buf.copy_(src.reshape(-1))
            src = buf
        compute = self.compute_stream()
        self.stream.wait_stream(compute)  # earlier compute may still read dst
        with self.stream:
            dst.copy_(src.reshape(dst.shape), non_blocking=self.pinned and src.is_pinned())
        self.stream.keep(dst)
        compute.wait_event(self.stream.record_event())
        self.stats.uploads += 1
        self.stats.bytes_up += src.numel() * src.element_size()

    def to_host(self, src: torch.Tensor, key: object = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``src`` as a 1-D host tensor of ``dtype`` (a reusable buffer when ``key`` is given;
        without a boundary, ``src`` itself when no conversion is needed)."""
        dtype = dtype or src.dtype
        if not self.crosses:
            return src.reshape(-1) if dtype == src.dtype else src.reshape(-1).to(dtype)
        n = src.numel()
        dst = self.host_buffer(key, n, dtype) if key is not None else self.host_empty(n, dtype)
        self.download(dst, src)
        return dst

    def to_device(self, src: torch.Tensor) -> torch.Tensor:
        """A device copy of host ``src`` (``src`` itself without a boundary)."""
        if not self.crosses:
            return src
        dst = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        self.upload(dst, src)
        return dst

    def wait_host(self) -> None:
        """Block until every download issued so far has landed in host memory."""
        for ev in self._pending:
            ev.synchronize()
        self._pending.clear()
