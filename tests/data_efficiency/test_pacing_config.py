"""Pacing functions against DeepSpeed's formulas; the data_efficiency and legacy curriculum_learning
config sections; the sequence-length and voc metrics against hand-worked values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from zeal.config import ConfigError, load_config
from zeal.data.curriculum import (
    Pacing,
    pacing_difficulty,
    seqlen_reshape,
    seqlen_truncate,
    token_counts,
    voc_metric,
)

pytestmark = pytest.mark.timeout(60)


def _root(t, lo, hi, total, step, r):
    """The formula, written out independently: floor((t/T)^(1/r)·(hi−lo)+lo), rounded down to step, capped."""
    f = math.floor((t / total) ** (1 / r) * (hi - lo) + lo)
    return min(hi, f - f % step)


@pytest.mark.parametrize("lo,hi,total,step", [(8, 1024, 100, 8), (10, 100, 7, 8), (1, 100, 50, 1)])
def test_fixed_linear_and_root_match_the_formula(lo, hi, total, step):
    for r in (1, 2, 3):
        kind = "fixed_linear" if r == 1 else "fixed_root"
        sc = {"total_curriculum_step": total, "difficulty_step": step} | ({"root_degree": r} if r > 1 else {})
        for t in range(0, 2 * total):
            assert pacing_difficulty(t, kind, lo, hi, sc) == _root(t, lo, hi, total, step, r), (kind, t)
    # root degree 1 is linear, everywhere
    lin = {"total_curriculum_step": total, "difficulty_step": step}
    for t in range(0, 2 * total):
        assert pacing_difficulty(t, "fixed_root", lo, hi, lin | {"root_degree": 1}) == \
            pacing_difficulty(t, "fixed_linear", lo, hi, lin)


def test_boundaries_rounding_below_min_and_cap():
    sc = {"total_curriculum_step": 10, "difficulty_step": 8}
    assert pacing_difficulty(0, "fixed_linear", 10, 100, sc) == 8  # rounding falls below D_min (10 -> 8)
    assert pacing_difficulty(10, "fixed_linear", 10, 100, sc) == 96
    assert pacing_difficulty(10_000, "fixed_linear", 10, 96, sc) == 96  # capped at D_max


def test_fixed_discrete_at_and_after_each_step():
    sc = {"difficulty": [1, 2, 3], "max_step": [5, 10]}
    expect = {0: 1, 5: 1, 6: 2, 10: 2, 11: 3, 1000: 3}
    for t, d in expect.items():
        assert pacing_difficulty(t, "fixed_discrete", 1, 3, sc) == d


def test_pacing_state_stops_at_max_and_custom():
    p = Pacing("fixed_linear", 8, 64, {"total_curriculum_step": 4, "difficulty_step": 8})
    assert p.current == 8
    assert [p.update(t) for t in range(6)] == [8, 16, 32, 48, 64, 64]
    p.update(0)  # never recomputed once at max
    assert p.current == 64
    c = Pacing("custom", 1, 10)
    with pytest.raises(ValueError, match="set_custom"):
        c.update(3)
    c.set_custom(lambda t: t * 2)
    assert c.update(3) == 6


def test_data_efficiency_and_legacy_sections_load():
    cfg = load_config({
        "train_micro_batch_size_per_gpu": 2,
        "data_efficiency": {"enabled": True, "seed": 7, "data_sampling": {"curriculum_learning": {
            "enabled": True, "curriculum_metrics": {
                "seqlen_truncate": {"difficulty_type": "value", "clustering_type": "single_cluster",
                                    "min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_linear",
                                    "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8}},
                "voc": {"index_to_sample_path": "a.npy", "index_to_metric_path": "b.npy",
                        "difficulty_type": "percentile", "min_difficulty": 1, "max_difficulty": 100,
                        "schedule_type": "fixed_root", "schedule_config": {
                            "total_curriculum_step": 10, "difficulty_step": 1, "root_degree": 2}}}}},
            "data_routing": {"random_ltd": {"enabled": True, "random_ltd_layer_id": [1, 2],
                                            "random_ltd_schedule": {"min_value": 16, "max_value": 64,
                                                                    "schedule_config": {"require_steps": 10,
                                                                                        "seq_per_step": 8}}}}},
        "curriculum_learning": {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8,
                                "max_difficulty": 64, "schedule_type": "fixed_discrete",
                                "schedule_config": {"difficulty": [8, 64], "max_step": [3]}}})
    de = cfg.data_efficiency
    assert de.seed == 7 and de.curriculum().curriculum_metrics["voc"].difficulty_type == "percentile"
    assert de.random_ltd().random_ltd_layer_id == [1, 2]
    assert cfg.curriculum_learning.schedule_config["max_step"] == [3]


@pytest.mark.parametrize("bad,match", [
    ({"curriculum_learning": {"enabled": True, "schedule_type": "fixed_linear",
                              "schedule_config": {"total_curriculum_step": 5}}}, "difficulty_step"),
    ({"curriculum_learning": {"enabled": True, "schedule_type": "fixed_discrete",
                              "schedule_config": {"difficulty": [1, 2], "max_step": []}}}, "max_step"),
    ({"data_efficiency": {"enabled": True, "data_routing": {"random_ltd": {"enabled": True}}}},
     "random_ltd_schedule"),
    ({"data_efficiency": {"enabled": True, "data_routing": {"random_ltd": {
        "enabled": True, "random_ltd_schedule": {"min_value": 8, "max_value": 16,
                                                 "schedule_config": {"require_steps": 3}}}}}}, "seq_per_step"),
])
def test_bad_sections_name_the_key(bad, match):
    with pytest.raises(ConfigError, match=match):
        load_config(bad)


def test_seqlen_truncate_and_reshape_shapes():
    x = torch.arange(2 * 10).view(2, 10)
    assert seqlen_truncate(x, 4).tolist() == [[0, 1, 2, 3], [10, 11, 12, 13]]
    assert seqlen_truncate(x, 10) is x
    r = seqlen_reshape(x, 4)
    # chunks [0..3],[4..7],[10..13],[14..17], then each row's last 4: [6..9],[16..19]; keep min(ceil(20/4), 6)=5 -> 4
    assert r.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [10, 11, 12, 13], [14, 15, 16, 17]]
    assert seqlen_reshape(x, 10) is x


def test_voc_metric_equals_the_formula():
    samples = [np.array([0, 1, 1]), np.array([2, 2, 3])]
    counts = token_counts(samples, 5)  # [1, 2, 2, 1, 0]
    assert counts.tolist() == [1, 2, 2, 1, 0]
    total = 1 + 2 + 2 + 1 + 1  # the zero count taken as 1
    want = [int(-math.log(1 / total) - 2 * math.log(2 / total)), int(-2 * math.log(2 / total) - math.log(1 / total))]
    assert voc_metric(samples, counts).tolist() == want


def test_deepspeed_json_sections_are_honoured_not_refused():
    from zeal.config.ds_compat import translate

    raw = {"data_efficiency": {"enabled": True, "data_sampling": {"curriculum_learning": {"enabled": False}}},
           "curriculum_learning": {"enabled": False}}
    cfg, _ = translate(raw)
    assert cfg["data_efficiency"]["enabled"] is True and "curriculum_learning" in cfg
    with pytest.raises(ValueError, match="dynamic batching"):
        translate({"data_efficiency": {"data_sampling": {"dynamic_batching": {"enabled": True}}}})
