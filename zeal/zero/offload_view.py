"""A temporary in-memory view of state that normally lives on disk, for code that
reads or writes all of it at once (checkpoints).

Inside ``in_memory(...)``: a :class:`SwappedZeroOptimizer` exposes ``masters`` and
``optimizer.state`` (exp_avg, exp_avg_sq, step) like the in-memory optimizer, and
disk-resident stage-3 shards are present as ``unit.shard``. With ``writeback`` the
(possibly changed) values go back to disk on exit. This costs, transiently, the
memory the disk tier otherwise saves (16 bytes per element of this rank's shard);
streaming checkpoints of the disk tier is left for later.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from zeal.zero.swapped_optimizer import SwappedZeroOptimizer
from zeal.zero.units import FlatUnit


@contextlib.contextmanager
def in_memory(zopt: object, home: object, units: list[FlatUnit], writeback: bool) -> Iterator[None]:
    disk_shards = bool(getattr(home, "lends", False))  # shards off the device (host memory or disk)
    swapped = isinstance(zopt, SwappedZeroOptimizer)
    if disk_shards:
        for u in units:
            u.shard = home.get(u).clone()
            home.done(u)
    if swapped:
        zopt.load_into_memory()
    try:
        yield
    finally:
        if swapped:
            zopt.release_memory(writeback)
        if disk_shards:
            for u in units:
                if writeback and not u.trainable:  # trainable shards were stored by the optimizer's write-back
                    home.put(u, u.shard)
                u.shard = torch.empty(0, dtype=u.dtype, device=u.device)
