"""The RNG tracker's model-parallel stream per pipeline stage: seeded
``seed + 100·pp_rank + 2718 + tp_rank`` (Megatron's offsets), compared with plain
``torch.Generator`` draws; the stages of one tp rank draw apart, stage 0 keeps the old seed."""

from __future__ import annotations

import torch

from zeal.parallel.rng import RNGTracker, model_parallel_seed


def _draw(seed: int, tp_rank: int, pp_rank: int) -> list[float]:
    tracker = RNGTracker()
    model_parallel_seed(seed, tp_rank, tracker, pp_rank=pp_rank)
    with tracker.fork():
        return torch.rand(3).tolist()


def test_each_pipeline_stage_its_own_stream():
    for tp_rank, pp_rank in [(0, 0), (1, 0), (0, 1), (1, 3)]:
        want = torch.rand(3, generator=torch.Generator().manual_seed(7 + 100 * pp_rank + 2718 + tp_rank)).tolist()
        assert _draw(7, tp_rank, pp_rank) == want
    assert _draw(7, 0, 0) != _draw(7, 0, 1) != _draw(7, 0, 2)
