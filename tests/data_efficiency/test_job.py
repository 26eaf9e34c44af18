"""Data efficiency in a `zeal train` job (one process, in-process): the logged difficulty and kept
tokens follow their formulas, consumed tokens follow the truncated batches, the token-based LR
follows its formula, and a resumed job continues the uninterrupted one exactly (curriculum
sampler state from the checkpoint)."""

from __future__ import annotations

import csv
import math

import pytest

from zeal.config.job import JobSpec, merge_engine_config
from zeal.data.curriculum import pacing_difficulty
from zeal.data.random_ltd import kept_tokens
from zeal.train.token_schedules import token_lr

pytestmark = pytest.mark.timeout(120)

SEQ, MICRO, LR = 16, 2, 1e-3
SEQLEN = {"min_difficulty": 8, "max_difficulty": SEQ, "schedule_type": "fixed_linear",
          "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 4}}
LTD = {"min_value": 4, "max_value": SEQ, "schedule_config": {"require_steps": 5, "seq_per_step": 4}}


def _spec(tmp_path, run, steps, resume=False):
    text = tmp_path / "text.txt"
    if not text.exists():
        text.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400)))
    job = {"hf_model": "gpt", "steps": steps, "nproc": 1, "run_dir": str(tmp_path / run), "eval_batches": 1, "eval_interval": 0,
           "save_interval": 3, "sample_tokens": 0, "report_to": "none", "resume": resume, "precision": "fp32",
           "lr": LR, "lr_warmup_tokens": 64, "lr_decay_tokens": 400, "lr_decay_style": "linear", "min_lr": 1e-4}
    engine = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 1},
              "curriculum_learning": {"enabled": True, "curriculum_type": "seqlen", **SEQLEN},
              "data_efficiency": {"enabled": True, "seed": 5,
                                  "data_sampling": {"curriculum_learning": {"enabled": True, "curriculum_metrics": {
                                      "voc": {"difficulty_type": "percentile", "min_difficulty": 50,
                                              "max_difficulty": 100, "schedule_type": "fixed_linear",
                                              "schedule_config": {"total_curriculum_step": 3,
                                                                  "difficulty_step": 10}}}}},
                                  "data_routing": {"random_ltd": {"enabled": True, "random_ltd_schedule": LTD}}}}
    spec = JobSpec(model={"n_layer": 3, "n_embd": 16, "n_head": 2}, data={"path": str(text), "seq_len": SEQ,
                                                                          "vocab_size": 300}, job=job)
    return spec.model_copy(update={"engine": merge_engine_config(spec.job, engine)})


def _rows(path):
    return [r for r in csv.DictReader(path.open()) if r["kind"] == "train"]


def test_job_logs_curriculum_and_ltd_and_resumes_exactly(tmp_path, monkeypatch):
    from zeal.train.job import run_job

    monkeypatch.setenv("ZEAL_CACHE", str(tmp_path / "cache"))
    run_job(_spec(tmp_path, "full", 6))
    rows = _rows(tmp_path / "full" / "metrics.csv")
    assert len(rows) == 6
    tokens = 0
    for t, r in enumerate(rows):
        d = pacing_difficulty(t, "fixed_linear", 8, SEQ, SEQLEN["schedule_config"])
        assert int(r["curriculum_difficulty"]) == d
        assert int(r["random_ltd_kept_tokens"]) == kept_tokens(t + 1, 4, SEQ, 5, 4)  # after the step
        tokens += MICRO * d
        assert int(r["tokens"]) == tokens
        assert math.isclose(float(r["lr"]), token_lr(tokens, LR, 1e-4, 64, 400, "linear"), rel_tol=1e-6)
    # resumed from the step-3 checkpoint: the same steps 4..6
    run_job(_spec(tmp_path, "part", 3))
    run_job(_spec(tmp_path, "part", 6, resume=True))
    again = _rows(tmp_path / "part" / "metrics.csv")
    assert [r["loss"] for r in again] == [r["loss"] for r in rows]
    assert [r["tokens"] for r in again] == [r["tokens"] for r in rows]
    assert (tmp_path / "full" / "loss.png").exists() or pytest.importorskip("matplotlib") is None
