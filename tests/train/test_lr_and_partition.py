"""Pure pieces: partition math (property tests) and LR schedules (formulas)."""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from zeal.train.lr_schedules import build_scheduler, warmup_cosine_ratio, warmup_decay_lr, warmup_lr
from zeal.zero.partition import bucketize, layout, padded_size, shard_range, slot_overlap


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_shards_tile_the_padded_buffer(numel, world):
    padded = padded_size(numel, world)
    assert padded % world == 0 and numel <= padded < numel + world
    ranges = [shard_range(padded, r, world) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == padded
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


@given(st.lists(st.integers(1, 50), min_size=1, max_size=20), st.integers(1, 8), st.integers(0, 7))
def test_slot_overlaps_cover_each_shard(sizes, world, rank):
    rank %= world
    slots, total = layout([(f"p{i}", (n,)) for i, n in enumerate(sizes)])
    lo, hi = shard_range(padded_size(total, world), rank, world)
    covered = sum(b - a for s in slots if (o := slot_overlap(s, lo, hi)) for a, b in [o])
    assert covered == max(0, min(hi, total) - lo)


@given(st.lists(st.integers(1, 100), max_size=30), st.integers(1, 200))
def test_bucketize_keeps_order_and_limit(sizes, limit):
    buckets = bucketize(sizes, limit)
    assert [i for b in buckets for i in b] == list(range(len(sizes)))
    for b in buckets:
        assert len(b) == 1 or sum(sizes[i] for i in b) <= limit


def test_warmup_schedules():  # the lr of the update after `step` steps (DeepSpeed: batch index step - 1)
    assert warmup_lr(0, 0.0, 1.0, 10, "linear") == 0.0
    assert warmup_lr(6, 0.0, 1.0, 10, "linear") == 0.5
    assert warmup_lr(50, 0.0, 1.0, 10, "linear") == 1.0
    assert math.isclose(warmup_lr(4, 0.0, 1.0, 10, "log"), math.log(4) / math.log(10))
    assert warmup_decay_lr(11, 20, 0.0, 1.0, 10, "linear") == 1.0
    assert warmup_decay_lr(16, 20, 0.0, 1.0, 10, "linear") == 0.5
    assert warmup_decay_lr(26, 20, 0.0, 1.0, 10, "linear") == 0.0
    assert math.isclose(warmup_cosine_ratio(10, 20, 0.0, 10, 0.0, "linear"), 0.9)
    assert math.isclose(warmup_cosine_ratio(15, 20, 0.0, 10, 0.0, "linear"), 0.5)
    assert warmup_cosine_ratio(0, total_num_steps=2, warmup_num_steps=1) == 0.0  # no 0/0 for a 1-step warm-up


def test_scheduler_steps_the_optimizer():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.5)
    sch = build_scheduler("WarmupCosineLR", {"total_num_steps": 10, "warmup_num_steps": 2, "warmup_type": "linear"}, opt)
    assert sch.get_last_lr() == [0.0]
    sch.step()
    assert sch.get_last_lr() == [0.0]  # DeepSpeed: the first two updates start the warm-up
    sch.step()
    assert sch.get_last_lr() == [0.25]
    state = sch.state_dict()
    sch.step()
    sch.load_state_dict(state)
    assert sch.get_last_lr() == [0.25]
