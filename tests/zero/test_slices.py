"""Slice math: the boxes of a flat range tile it exactly, in flat order, each contiguous;
writing a tensor through its boxes and reading it back is the identity."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zeal.zero.slices import (
    box_numel,
    box_shape,
    flat_range_boxes,
    flat_start,
    full_box,
    index,
    intersect,
    numel,
)


@st.composite
def shape_and_range(draw):
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=0, max_size=4)))
    n = numel(shape)
    lo = draw(st.integers(0, n))
    hi = draw(st.integers(lo, n))
    return shape, lo, hi


@pytest.mark.timeout(60)
@settings(max_examples=300, deadline=None)
@given(shape_and_range())
def test_boxes_tile_the_flat_range_in_order(case):
    shape, lo, hi = case
    boxes = flat_range_boxes(shape, lo, hi)
    ids = torch.arange(numel(shape)).view(shape)
    covered = [ids[index(b)].reshape(-1) for b in boxes]
    got = torch.cat(covered) if covered else torch.empty(0, dtype=torch.long)
    assert torch.equal(got, torch.arange(lo, hi))  # exactly [lo, hi), each element once, in order
    pos = lo
    for b in boxes:
        assert all(0 <= a < e <= d for (a, e), d in zip(b, shape))
        assert flat_start(shape, b) == pos  # each box is one contiguous flat range
        assert torch.equal(ids[index(b)].reshape(-1), torch.arange(pos, pos + box_numel(b)))
        pos += box_numel(b)
    assert len(boxes) <= max(1, 2 * len(shape) - 1)


@pytest.mark.timeout(60)
@settings(max_examples=200, deadline=None)
@given(shape_and_range(), st.integers(0, 2**31 - 1))
def test_write_and_read_back_through_boxes_is_identity(case, seed):
    shape, lo, hi = case
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    flat = t.reshape(-1)[lo:hi]  # what a rank holds of the flattened parameter
    out = torch.zeros(shape)
    pos = 0
    for b in flat_range_boxes(shape, lo, hi):
        piece = flat[pos:pos + box_numel(b)].view(box_shape(b))  # a view of the flat shard
        out[index(b)] = piece
        assert torch.equal(t[index(b)], piece)  # reading the box from the whole tensor
        pos += box_numel(b)
    mask = torch.zeros(numel(shape), dtype=torch.bool)
    mask[lo:hi] = True
    assert torch.equal(out.reshape(-1)[mask], t.reshape(-1)[mask])
    assert not out.reshape(-1)[~mask].any()


@pytest.mark.timeout(30)
def test_examples_and_intersection():
    assert flat_range_boxes((4, 5), 3, 17) == [((0, 1), (3, 5)), ((1, 3), (0, 5)), ((3, 4), (0, 2))]
    assert flat_range_boxes((4, 5), 5, 15) == [((1, 3), (0, 5))]
    assert flat_range_boxes((2, 3, 4), 5, 6) == [((0, 1), (1, 2), (1, 2))]
    assert flat_range_boxes((), 0, 1) == [()]
    assert flat_range_boxes((3,), 1, 1) == []
    with pytest.raises(ValueError):
        flat_range_boxes((2, 2), 1, 5)
    assert intersect(((0, 4), (2, 6)), ((1, 8), (0, 3))) == ((1, 4), (2, 3))
    assert intersect(((0, 2),), ((2, 4),)) is None
    assert index(((1, 4), (2, 3)), origin=((1, 8), (0, 3))) == (slice(0, 3), slice(2, 3))
    assert full_box((2, 3)) == ((0, 2), (0, 3)) and box_shape(((1, 4), (2, 3))) == (3, 1)
