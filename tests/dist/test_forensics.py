"""Hang forensics: a rank that skips a collective is named, with the collective, in the report.

Two real gloo ranks with a 3 s process-group timeout. Both all-reduce twice over the
world; then rank 0 all-reduces over a second group (``dp``) while rank 1 skips it and
goes on (after some work) to the next world all-reduce. Both wait until the timeout,
dump their records, and the report built from the two files names the dp all-reduce
(its call site in this file) and rank 1. Unit tests of the divergence finder use
hand-written records.
"""

from __future__ import annotations

import time

import pytest

from tests.dist_harness import run_ranks
from zeal.dist import forensics



def _skip_one(rank: int, world: int, folder: str) -> str:
    import os

    os.environ[forensics.ENV_DIR] = folder
    os.environ[forensics.ENV_TIMEOUT] = "3"
    import torch
    import torch.distributed as dist

    from zeal.dist.comm import Comm
    from zeal.dist.context import init_distributed

    ctx = init_distributed()
    world_comm = Comm(ctx, name="world")
    dp = Comm(ctx, group=dist.new_group([0, 1]), ranks=[0, 1], name="dp")
    for _ in range(2):
        world_comm.all_reduce(torch.ones(4), "grad")
    try:
        if rank == 0:
            dp.all_reduce(torch.ones(3), "grad")  # SKIPPED BY RANK 1
        else:
            time.sleep(0.3)  # rank 1 takes another path, and later ...
        world_comm.all_reduce(torch.ones(4), "grad")
    except RuntimeError:
        return "timed out"
    return "finished"


@pytest.mark.timeout(60)
def test_skipped_collective_is_named(tmp_path):
    t0 = time.monotonic()
    outcome = run_ranks(_skip_one, 2, str(tmp_path), timeout=45)
    assert outcome == ["timed out", "timed out"]
    assert sorted(p.name for p in tmp_path.glob("collectives-rank*.json")) == \
        ["collectives-rank0.json", "collectives-rank1.json"]
    found = forensics.divergences(forensics.read_records(tmp_path))
    first = found[0]
    assert first["group"] == "dp" and first["skipped"] == [1] and first["seq"] == 0
    assert first["expected"]["op"] == "all_reduce" and first["expected"]["shape"] == [3]
    line = next(i for i, t in enumerate(open(__file__).read().splitlines(), 1) if "# SKIPPED BY RANK 1" in t)
    assert first["expected"]["site"].endswith(f"test_forensics.py:{line}")
    text = forensics.report(tmp_path)
    assert "first divergence: group dp" in text and "skipped by rank(s) [1]" in text
    assert f"test_forensics.py:{line}" in text
    assert time.monotonic() - t0 < 45


def _rec(seq, op="all_reduce", shape=(4,), site="a.py:1", t=0.0, group="world", ranks=(0, 1)):
    return {"seq": seq, "group": group, "ranks": list(ranks), "op": op, "shape": list(shape), "dtype": "torch.float32",
            "site": site, "time": t}


def test_divergence_on_one_group_names_the_rank_that_skipped_ahead():
    # rank 1 skipped position 1 (site b) and issued c there instead
    r0 = [_rec(0, site="a"), _rec(1, site="b", t=1), _rec(2, site="c", t=2)]
    r1 = [_rec(0, site="a"), _rec(1, site="c", t=1.5)]
    found = forensics.divergences({0: {"records": r0}, 1: {"records": r1}})
    assert len(found) == 1
    f = found[0]
    assert (f["seq"], f["expected"]["site"], f["skipped"], f["other"]) == (1, "b", [1], {})


def test_majority_decides_and_a_different_op_is_reported_as_other():
    recs = {r: {"records": [_rec(0, ranks=(0, 1, 2)), _rec(1, ranks=(0, 1, 2), t=1)]} for r in range(3)}
    recs[2]["records"][1] = _rec(1, op="broadcast", ranks=(0, 1, 2), t=1)
    f = forensics.divergences(recs)[0]
    assert f["expected"]["op"] == "all_reduce" and f["skipped"] == [] and list(f["other"]) == [2]
    assert forensics.divergences({r: {"records": [_rec(0)]} for r in range(2)}) == []


def test_timeout_knob(monkeypatch):
    monkeypatch.setenv(forensics.ENV_TIMEOUT, "2.5")
    assert forensics.comm_timeout_s(100) == 2.5
    monkeypatch.delenv(forensics.ENV_TIMEOUT)
    assert forensics.comm_timeout_s(100) == 100 and forensics.comm_timeout_s(None) == 600
    monkeypatch.setenv(forensics.ENV_TIMEOUT, "soon")
    with pytest.raises(ValueError, match="ZEAL_COMM_TIMEOUT_S"):
        forensics.comm_timeout_s()
