"""Process-wide settings, applied by the commands (``zeal train``, ``zeal serve``) and
the job runner before a model is built; ``import zeal`` sets none of them.

A script that builds models itself calls :func:`apply_process_settings` first
thing, before torch allocates a tensor, to run as the commands do.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from typing import Any

from zeal.config.process import ProcessConfig

log = logging.getLogger("zeal")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def apply_process_settings(settings: ProcessConfig | dict[str, Any] | None = None) -> dict[str, Any]:
    """Apply the ``process`` section (default: its defaults) to this process and to the
    processes it starts; returns what was set. Safe to call more than once."""
    s = settings if isinstance(settings, ProcessConfig) else ProcessConfig.model_validate(settings or {})
    applied: dict[str, Any] = {}
    if s.transparent_hugepages:
        # torch's CPU allocator reads this once, at its first allocation; children inherit it
        applied["THP_MEM_ALLOC_ENABLE"] = os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    if s.num_threads is not None:
        import torch

        torch.set_num_threads(s.num_threads)
        applied["num_threads"] = s.num_threads
    if s.malloc_release_threshold is not None:
        applied["malloc_release_threshold"] = set_malloc_thresholds(s.malloc_release_threshold)
    return applied


def set_malloc_thresholds(threshold_bytes: int) -> bool:
    """Set glibc's mmap and trim thresholds, so that freed blocks of ``threshold_bytes``
    and more go back to the OS at once; True when it took effect (glibc only)."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, threshold_bytes) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, threshold_bytes) == 1 and ok
    except (OSError, AttributeError):
        return False
    if ok:
        log.debug("glibc mmap/trim thresholds set to %d bytes", threshold_bytes)
    return ok


def trim_heap() -> bool:
    """Give the heap's free pages back to the OS now (glibc ``malloc_trim``); True when
    it ran. Freed blocks that glibc served from its heap (below its mmap threshold, which
    it raises by itself after large frees) otherwise stay resident."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True
