"""The analyzer's map-reduce against a single-process analysis; the curriculum sampler's eligibility,
uniformity (chi-square), disjointness over 2 data-parallel ranks and exact resume."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from zeal.data.analyzer import MetricIndex, analyze, load_sample_metric
from zeal.data.curriculum import Pacing, token_counts, voc_metric
from zeal.data.curriculum_sampler import CurriculumSampler, IndexedMetric

pytestmark = pytest.mark.timeout(60)


def _corpus(n=60, t=16, vocab=50, seed=0):
    rng = np.random.default_rng(seed)
    # a skewed token distribution so the voc metric spreads
    p = 1.0 / np.arange(1, vocab + 1)
    return rng.choice(vocab, size=(n, t), p=p / p.sum()).astype(np.int64)


def test_analyzer_merge_equals_single_worker_and_formula(tmp_path):
    rows = _corpus()
    one = analyze(rows, "voc", workers=1, vocab_size=50)
    three = analyze(rows, "voc", workers=3, vocab_size=50)
    for name in ("sample_to_metric", "index_to_sample", "index_to_metric"):
        assert np.array_equal(getattr(one, name), getattr(three, name)), name
    # the single analysis is the formula over the whole data
    assert np.array_equal(one.sample_to_metric, voc_metric(rows, token_counts(rows, 50)))
    assert (np.diff(one.index_to_metric) >= 0).all()
    assert np.array_equal(one.sample_to_metric[one.index_to_sample], one.index_to_metric)
    paths = one.save(tmp_path, "voc")
    back = MetricIndex.load(tmp_path, "voc")
    assert np.array_equal(back.index_to_sample, one.index_to_sample)
    assert np.array_equal(load_sample_metric(paths[1], paths[2]), one.sample_to_metric)
    assert all(np.load(p, allow_pickle=False).dtype == np.int64 for p in paths)


def _sampler(values, kind="value", lo=2, hi=10, total=4, rank=0, dp=1, micro=4, seed=3):
    pacing = Pacing("fixed_linear", lo, hi, {"total_curriculum_step": total, "difficulty_step": 1})
    return CurriculumSampler({"m": IndexedMetric(values, pacing, kind)}, micro_batch=micro, dp_size=dp,
                             dp_rank=rank, seed=seed)


def test_eligibility_value_and_percentile():
    values = np.arange(100) % 11  # metric 0..10
    s = _sampler(values)
    for _ in range(8):
        batch = s.next_global_batch()
        d = s.difficulties()["m"]
        assert (values[batch] <= d).all() and len(set(batch.tolist())) == len(batch)
    ps = _sampler(np.arange(200)[::-1].copy(), kind="percentile", lo=10, hi=100, total=5, micro=8)
    sorted_ids = np.argsort(np.arange(200)[::-1], kind="stable")
    for _ in range(7):
        batch = ps.next_global_batch()
        p = ps.difficulties()["m"]
        allowed = set(sorted_ids[: (200 // 100) * p].tolist()) if p < 100 else set(range(200))
        assert set(batch.tolist()) <= allowed


def _chi2_threshold(df, z=3.09):  # Wilson-Hilferty 0.999 quantile (no scipy needed)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_uniform_over_the_eligible_samples():
    values = np.arange(40) % 4  # difficulty fixed at 1: eligible = metric in {0, 1} -> 20 samples
    s = _sampler(values, lo=1, hi=1, micro=5)
    counts = np.zeros(40)
    for _ in range(600):
        np.add.at(counts, s.next_global_batch(), 1)
    assert counts[values > 1].sum() == 0
    obs = counts[values <= 1]
    exp = obs.sum() / len(obs)
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    assert chi2 < _chi2_threshold(len(obs) - 1), chi2
    # the same test rejects a sampler that favours a quarter of the pool by 1.5x
    skew = obs.copy()
    skew[:5] *= 1.5
    exp_skew = skew.sum() / len(skew)
    assert float(((skew - exp_skew) ** 2 / exp_skew).sum()) > _chi2_threshold(len(obs) - 1)


def test_two_ranks_disjoint_and_cover_the_global_batch():
    values = np.arange(64) % 8
    r0, r1 = (_sampler(values, rank=r, dp=2, micro=3) for r in (0, 1))
    ref = _sampler(values, rank=0, dp=1, micro=6)
    for _ in range(10):
        a, b, g = r0.next_rank_batch(), r1.next_rank_batch(), ref.next_global_batch()
        assert len(a) == len(b) == 3 and not set(a.tolist()) & set(b.tolist())
        assert np.array_equal(np.concatenate([a, b]), g)


def test_exact_resume_from_state_dict():
    values = np.arange(50) % 10
    s = _sampler(values, micro=4, total=20)
    for _ in range(5):
        s.next_global_batch()
    sd = s.state_dict()
    assert isinstance(sd["generator"], torch.Tensor) and sd["generator"].dtype == torch.uint8
    torch.manual_seed(999)  # the global generator is not what it uses
    np.random.seed(999)
    rest = [s.next_global_batch() for _ in range(8)]
    fresh = _sampler(values, micro=4, total=20, seed=12345)
    fresh.load_state_dict({"step": sd["step"], "generator": sd["generator"].tolist(),
                           "difficulties": sd["difficulties"]})
    again = [fresh.next_global_batch() for _ in range(8)]
    assert all(np.array_equal(a, b) for a, b in zip(rest, again))
    replay = _sampler(values, micro=4, total=20)
    replay.set_position(5 * replay.global_batch)  # the engine's resume: replayed from the seed
    assert all(np.array_equal(a, replay.next_global_batch()) for a in rest)


def test_zeal_data_analyze_cli(tmp_path, monkeypatch, capsys):
    from zeal.cli.main import main

    monkeypatch.setenv("ZEAL_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "t.txt"
    text.write_text("".join(f"class C{i}:\n    value = {i * i}  # {'x' * (i % 13)}\n" for i in range(300)))
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        assert main(["data", "analyze", str(text), "--metric", "voc", "--workers", str(workers), "--out", str(out),
                     "--seq-len", "16", "--vocab-size", "300"]) == 0
        outs.append(MetricIndex.load(out, "voc"))
    printed = capsys.readouterr().out
    assert "voc over" in printed and "#" in printed and "voc_index_to_sample.npy" in printed
    assert all(np.array_equal(getattr(outs[0], n), getattr(outs[1], n))
               for n in ("sample_to_metric", "index_to_sample", "index_to_metric"))
    assert main(["data", "analyze", str(tmp_path / "missing.txt")]) == 2


def test_initialize_training_data_uses_the_curriculum_sampler(tmp_path):
    import zeal
    from zeal.models import GPT, GPTConfig

    values = np.arange(40) % 10
    p = MetricIndex.from_values(values).save(tmp_path, "mymetric")
    data = torch.utils.data.TensorDataset(torch.arange(40))
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "data_efficiency": {"enabled": True, "data_sampling": {"curriculum_learning": {
               "enabled": True, "curriculum_metrics": {"mymetric": {
                   "index_to_sample_path": str(p[1]), "index_to_metric_path": str(p[2]), "min_difficulty": 2,
                   "max_difficulty": 9, "schedule_type": "fixed_linear",
                   "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 1}}}}}}}
    engine = zeal.initialize(GPT(GPTConfig(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=1)), cfg,
                             training_data=data)
    assert isinstance(engine.dataloader.sampler, CurriculumSampler)
    (first,) = next(iter(engine.dataloader))
    assert len(first) == 4 and (values[first.numpy()] <= 2).all()
    engine.close()
