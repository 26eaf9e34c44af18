"""Make freed host memory go back to the OS promptly (glibc only).

Stage 3 and the disk tier exist to bound host memory. Stage 3 allocates and frees gathered
units and gradient buffers of tens of MB every step; glibc serves allocations
below its (dynamic, up to 32 MB) mmap threshold from the heap, where freed
blocks fragment and stay resident. Pinning the threshold at 1 MB makes every
large tensor an mmap of its own, returned to the OS when freed. No effect on
other C libraries.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("zeal")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def return_freed_memory_eagerly(threshold_bytes: int = 1 << 20) -> bool:
    """Set glibc's mmap and trim thresholds; True when it took effect."""
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
