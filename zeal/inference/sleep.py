"""Sleep and wake: device memory given back between phases and taken again (vLLM's
``sleep`` / ``wake_up``), for RLHF loops that train and generate in turn.

Memory is released by shrinking each tensor's storage to zero bytes and restored by
growing it back: the tensors themselves (the KV cache lists of the model runner, the
model's parameters) stay the same objects, so nothing that holds them needs to know.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from zeal.utils.process import trim_heap


class EngineAsleepError(RuntimeError):
    """The engine was asked to generate while its memory is released."""


@dataclass
class Released:
    """Storages shrunk to zero bytes, with their sizes, and (for offloaded weights)
    host copies of the tensors to write back."""

    storages: list[tuple[torch.UntypedStorage, int]] = field(default_factory=list)
    host_copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (tensor, host copy)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.storages)


def _unique(tensors: Iterable[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.UntypedStorage]]:
    """The tensors once each and their storages once each (tied weights share one)."""
    seen_t: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    seen_s: set[int] = set()
    ts, ss = [], []
    for t in tensors:
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if key in seen_t:
            continue
        seen_t.add(key)
        ts.append(t)
        st = t.untyped_storage()
        if st.data_ptr() not in seen_s:
            seen_s.add(st.data_ptr())
            ss.append(st)
    return ts, ss


def release(tensors: Iterable[torch.Tensor], keep_on_host: bool = False) -> Released:
    """Shrink the storages of ``tensors`` to zero bytes; with ``keep_on_host`` their
    contents are first copied to CPU memory (for :func:`restore` to write back)."""
    ts, storages = _unique(tensors)
    fixed = [st for st in storages if not st.resizable()]
    if fixed:
        raise RuntimeError(f"cannot release {len(fixed)} tensor storage(s) that are not resizable "
                           "(memory-mapped or borrowed from another library)")
    out = Released()
    if keep_on_host:
        out.host_copies = [(t, t.detach().to("cpu", copy=True)) for t in ts]
    for st in storages:
        out.storages.append((st, st.nbytes()))
        st.resize_(0)
    if any(st.device.type == "cuda" for st, _ in out.storages):
        torch.cuda.empty_cache()  # back to the driver, not only to torch's caching allocator
    if any(st.device.type == "cpu" for st, _ in out.storages):
        trim_heap()  # back to the OS, also where glibc kept the blocks in its heap
    return out


@torch.no_grad()
def restore(released: Released, zero: bool = False) -> None:
    """Grow the storages back to their sizes; write back host copies, else zero them
    (``zero``) or leave them uninitialised (weights that are about to be loaded)."""
    for st, nbytes in released.storages:
        st.resize_(nbytes)
        if zero:
            st.fill_(0)
    for t, host in released.host_copies:
        t.copy_(host)
    released.storages.clear()
    released.host_copies.clear()
