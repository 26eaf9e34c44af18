"""SavedShards reads any box of a parameter saved as N-d boxes (here column blocks, as a
tensor-parallel split would save them), touching only the files whose boxes meet it,
and reports boxes the saved pieces do not cover."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zeal.checkpoint.files import CheckpointCorruptError, TensorSpec, write_safetensors
from zeal.checkpoint.reader import SavedShards

SHAPE = (6, 10)
FULL = torch.arange(60, dtype=torch.float32).view(SHAPE)
# rank 0: columns [0, 4); rank 1: columns [4, 10) as two boxes (rows [0, 3) and [3, 6))
BOXES = [[((0, 6), (0, 4))], [((0, 3), (4, 10)), ((3, 6), (4, 10))]]


def _write(folder: Path, boxes=BOXES) -> list[str]:
    files = []
    for rank, owned in enumerate(boxes):
        specs = []
        for k, box in enumerate(owned):
            t = FULL[tuple(slice(a, b) for a, b in box)].contiguous()
            specs.append(TensorSpec(f"param/w/{k}", t.dtype, tuple(t.shape), lambda t=t: t))
        md = {"rank": rank, "world_size": len(boxes), "boxes": {"w": [[list(r) for r in b] for b in owned]},
              "scalars": {}}
        files.append(f"rank{rank:05d}.safetensors")
        write_safetensors(folder / files[-1], specs, {"zeal": json.dumps(md)})
    return files


class _Counting(SavedShards):
    opened: list[int]

    def _reader(self, i: int):
        self.opened.append(i)
        return super()._reader(i)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> _Counting:
    folder = tmp_path_factory.mktemp("boxes")
    s = _Counting(folder, _write(folder), {"w": list(SHAPE)}, version=2)
    s.opened = []
    return s


@pytest.mark.timeout(60)
@settings(max_examples=100, deadline=None)
@given(st.integers(0, 5), st.integers(1, 6), st.integers(0, 9), st.integers(1, 10))
def test_any_box_reads_back(shards, r0, nr, c0, nc):
    box = ((r0, min(6, r0 + nr)), (c0, min(10, c0 + nc)))
    out = torch.empty(box[0][1] - box[0][0], box[1][1] - box[1][0])
    shards.opened = []
    shards.read("param", "w", box, out)
    assert torch.equal(out, FULL[box[0][0]:box[0][1], box[1][0]:box[1][1]])
    want_files = {0} if box[1][1] <= 4 else {1} if box[1][0] >= 4 else {0, 1}
    assert set(shards.opened) == want_files


@pytest.mark.timeout(30)
def test_uncovered_box_is_a_corrupt_checkpoint(tmp_path):
    holes = [[((0, 6), (0, 4))], [((0, 3), (4, 10))]]  # rows [3, 6) of columns [4, 10) missing
    s = SavedShards(tmp_path, _write(tmp_path, holes), {"w": list(SHAPE)}, version=2)
    with pytest.raises(CheckpointCorruptError, match="cover 6 of the 24"):
        s.read("param", "w", ((2, 6), (4, 10)), torch.empty(4, 6))
