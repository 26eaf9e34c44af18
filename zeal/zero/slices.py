"""N-dimensional slices of a tensor: pure functions of shapes and index ranges.

A *box* is a rectangular N-d slice of a tensor of a given shape: one ``(start, stop)``
pair per dimension, stops exclusive (``()`` is the whole of a 0-d tensor). Boxes are
how the sharded-state API and checkpoints describe what a rank owns of a parameter,
whether it owns a column block of a tensor-parallel weight or a flat range of a
flattened parameter (ZeRO).

A flat range ``[lo, hi)`` of a row-major tensor is in general not a box (it may start
and end mid-row). :func:`flat_range_boxes` splits it into boxes, recursively over the
dimensions: a partial first row, a block of whole rows, a partial last row, where each
partial row is split the same way over the remaining dimensions. Every box it returns
has the form ``(i, i+1), ..., (i, i+1), (a, b), whole, ..., whole`` and is therefore
one contiguous flat range itself; the boxes follow each other in flat order and tile
``[lo, hi)`` exactly, so box k is the flat piece ``[lo + Σ_{j<k} numel_j, ... )``:
a view of a flat shard, with no copy. A d-dimensional range gives at most ``2d - 1``
boxes (one per dimension on each side, plus the middle block).
"""

from __future__ import annotations

from collections.abc import Sequence

Box = tuple[tuple[int, int], ...]


def numel(shape: Sequence[int]) -> int:
    """Number of elements of a tensor of ``shape`` (1 for a 0-d tensor)."""
    n = 1
    for d in shape:
        n *= d
    return n


def full_box(shape: Sequence[int]) -> Box:
    """The box covering all of a tensor of ``shape``."""
    return tuple((0, d) for d in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def box_numel(box: Box) -> int:
    return numel(box_shape(box))


def flat_start(shape: Sequence[int], box: Box) -> int:
    """Flat (row-major) index of the box's first element in a tensor of ``shape``."""
    off = 0
    for d, (a, _) in zip(shape, box):
        off = off * d + a
    return off


def flat_range_boxes(shape: Sequence[int], lo: int, hi: int) -> list[Box]:
    """The boxes tiling flat elements ``[lo, hi)`` of a row-major tensor of ``shape``,
    in flat order, each one contiguous (see the module docstring)."""
    shape = tuple(shape)
    if not 0 <= lo <= hi <= numel(shape):
        raise ValueError(f"flat range [{lo}, {hi}) outside a tensor of shape {shape}")
    if lo == hi:
        return []
    if not shape:
        return [()]
    return _split(shape, lo, hi)


def _split(shape: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    # 0 <= lo < hi <= numel(shape), len(shape) >= 1
    if len(shape) == 1:
        return [((lo, hi),)]
    rest = shape[1:]
    row = numel(rest)  # elements per index of dim 0
    first, last = lo // row, (hi - 1) // row
    if first == last:  # inside one row: split the row over the remaining dimensions
        return [((first, first + 1), *b) for b in _split(rest, lo - first * row, hi - first * row)]
    whole_lo, whole_hi = -(-lo // row), hi // row  # rows fully inside [lo, hi)
    out: list[Box] = []
    if lo % row:
        out += [((first, first + 1), *b) for b in _split(rest, lo % row, row)]
    if whole_lo < whole_hi:
        out.append(((whole_lo, whole_hi), *full_box(rest)))
    if hi % row:
        out += [((whole_hi, whole_hi + 1), *b) for b in _split(rest, 0, hi % row)]
    return out


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of the same tensor, or None when they do not meet."""
    if len(a) != len(b):
        raise ValueError(f"boxes of different rank: {a} and {b}")
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    if any(s >= e for s, e in out):
        return None
    return out


def index(box: Box, origin: Box | None = None) -> tuple[slice, ...]:
    """Indexing slices of ``box`` in a tensor, or, given ``origin``, in a tensor that
    holds just the box ``origin`` (which must contain ``box``)."""
    if origin is None:
        return tuple(slice(a, b) for a, b in box)
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, origin))
