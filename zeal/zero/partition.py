"""Partition math: pure functions of sizes, unit-tested alone.

A *unit* is a group of parameters laid out back to back in one flat buffer, padded
at the end to a multiple of the world size N. Rank r owns the contiguous shard
``[r·S, (r+1)·S)`` with ``S = padded / N``. Padding stays zero forever: its gradient
is zero, so Adam/SGD updates leave it at zero and it adds nothing to norms.
"""

from __future__ import annotations

from dataclasses import dataclass


def padded_size(numel: int, world: int) -> int:
    """Smallest multiple of ``world`` that is >= numel (0 stays 0)."""
    return -(-numel // world) * world


def shard_range(padded: int, rank: int, world: int) -> tuple[int, int]:
    """[start, end) of rank's shard in a padded flat buffer."""
    s = padded // world
    return rank * s, (rank + 1) * s


@dataclass(frozen=True)
class Slot:
    """One parameter inside a unit: its name, shape and [offset, offset + numel)."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


def layout(names_shapes: list[tuple[str, tuple[int, ...]]]) -> tuple[list[Slot], int]:
    """Back-to-back slots and the unpadded total."""
    slots, off = [], 0
    for name, shape in names_shapes:
        n = 1
        for d in shape:
            n *= d
        slots.append(Slot(name, tuple(shape), off, n))
        off += n
    return slots, off


def slot_overlap(slot: Slot, start: int, end: int) -> tuple[int, int] | None:
    """The part of ``slot`` inside the flat range [start, end), as offsets *within the
    parameter* (flattened), or None when they do not overlap."""
    lo, hi = max(slot.offset, start), min(slot.end, end)
    if lo >= hi:
        return None
    return lo - slot.offset, hi - slot.offset


def bucketize(sizes: list[int], bucket_elems: int) -> list[list[int]]:
    """Greedy consecutive grouping of item indices so that each bucket holds at most
    ``bucket_elems`` elements (an item larger than that gets a bucket of its own)."""
    buckets: list[list[int]] = []
    cur: list[int] = []
    cur_n = 0
    for i, n in enumerate(sizes):
        if cur and cur_n + n > bucket_elems:
            buckets.append(cur)
            cur, cur_n = [], 0
        cur.append(i)
        cur_n += n
    if cur:
        buckets.append(cur)
    return buckets
