"""The curriculum sampler on 2 real gloo ranks through ``initialize(training_data=...)``: each
step the two ranks' batches are disjoint, together equal the single-process global batch, and
lie within the step's difficulty; after ``load_checkpoint`` in fresh engines both ranks continue
with exactly the batches of the uninterrupted run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tests.dist_harness import run_ranks

pytestmark = pytest.mark.timeout(120)

N, MICRO, STEPS, SAVE_AT = 48, 3, 6, 3


class _PerSample(nn.Module):
    """A parameter per sample id, so every step really trains."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(N, 4)

    def forward(self, ids):
        return self.emb(ids).pow(2).mean()


def _config(folder):
    from zeal.data.analyzer import MetricIndex

    paths = MetricIndex.from_values(np.arange(N) % 12).save(folder, "mymetric")
    return {"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": 1},
            "data_efficiency": {"enabled": True, "seed": 77, "data_sampling": {"curriculum_learning": {
                "enabled": True, "curriculum_metrics": {"mymetric": {
                    "index_to_sample_path": str(paths[1]), "index_to_metric_path": str(paths[2]),
                    "min_difficulty": 2, "max_difficulty": 11, "schedule_type": "fixed_linear",
                    "schedule_config": {"total_curriculum_step": STEPS, "difficulty_step": 1}}}}}}}


def _engine(cfg):
    import zeal

    torch.manual_seed(0)
    return zeal.initialize(_PerSample(), cfg, training_data=torch.utils.data.TensorDataset(torch.arange(N)))


def _rank(rank, world, folder):
    cfg = _config(folder)
    engine = _engine(cfg)
    seen, it = [], iter(engine.dataloader)
    for step in range(STEPS):
        (ids,) = next(it)
        seen.append(ids.tolist())
        engine.backward(engine(ids))
        engine.step()
        if step + 1 == SAVE_AT:
            engine.save_checkpoint(f"{folder}/ckpt")
    engine.close()
    fresh = _engine(cfg)
    fresh.load_checkpoint(f"{folder}/ckpt")
    it = iter(fresh.dataloader)
    resumed = [next(it)[0].tolist() for _ in range(STEPS - SAVE_AT)]
    fresh.close()
    return {"seen": seen, "resumed": resumed}


def test_two_ranks_disjoint_cover_the_global_batch_and_resume(tmp_path):
    from zeal.config import load_config
    from zeal.data.curriculum_sampler import sampler_from_config

    out = run_ranks(_rank, 2, str(tmp_path), timeout=100)
    ref = sampler_from_config(load_config(_config(tmp_path)), N, 2 * MICRO, 1, 0, 1)
    values, bounds = np.arange(N) % 12, []
    for step in range(STEPS):
        a, b = out[0]["seen"][step], out[1]["seen"][step]
        assert len(a) == len(b) == MICRO and not set(a) & set(b)
        whole = ref.next_global_batch()
        assert a + b == whole.tolist()
        bounds.append(ref.difficulties()["mymetric"])
        assert (values[whole] <= bounds[-1]).all()
    assert bounds[0] == 2 and bounds == sorted(bounds) and bounds[-1] > 2  # the curriculum really paces
    for r in (0, 1):
        assert out[r]["resumed"] == out[r]["seen"][SAVE_AT:]
