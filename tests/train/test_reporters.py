"""``job.report_to``: TensorBoard and Weights & Biases (offline) beside the CSV/JSONL
metrics; a missing package is skipped with a message, never an error. The trackers
are replaced by stand-in modules here (neither package is a test dependency)."""

from __future__ import annotations

import sys
import types

import pytest
from pydantic import ValidationError

from zeal.config.job import JobSection
from zeal.train.metrics import MetricsSink, read_metrics
from zeal.train.reporters import open_reporters

pytestmark = pytest.mark.timeout(60)


def test_missing_packages_are_skipped_with_a_message(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    said = []
    assert open_reporters(tmp_path, ["tensorboard", "wandb"], say=lambda m, **_: said.append(m)) == []
    assert len(said) == 2 and all("not installed" in m and "pip install" in m for m in said), said
    said.clear()
    assert open_reporters(tmp_path, None, say=lambda m, **_: said.append(m)) == [] and said == []  # default: quiet
    sink = MetricsSink(tmp_path, report_to=["wandb"])
    sink.log({"step": 1, "kind": "train", "loss": 2.0})
    sink.close()
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["loss"] == 2.0


def test_wandb_offline_and_tensorboard_receive_the_scalars(tmp_path, monkeypatch):
    calls: list[tuple] = []

    class Run:
        def log(self, data, step):
            calls.append(("wandb.log", data, step))

        def finish(self):
            calls.append(("wandb.finish",))

    def init(**kwargs):
        calls.append(("wandb.init", kwargs))
        return Run()

    class SummaryWriter:
        def __init__(self, logdir):
            calls.append(("tb", logdir))

        def add_scalar(self, name, value, step):
            calls.append(("tb.scalar", name, value, step))

        def close(self):
            calls.append(("tb.close",))

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=SummaryWriter))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    sink = MetricsSink(tmp_path, report_to=["tensorboard", "wandb"], run_config={"job": {"steps": 3}})
    sink.log({"step": 3, "kind": "train", "loss": 1.5, "lr": 1e-3, "grad_norm": float("nan"), "tokens": 10})
    sink.log({"step": 3, "kind": "eval", "loss": 1.7})
    sink.close()
    init_kw = next(c[1] for c in calls if c[0] == "wandb.init")
    assert init_kw["mode"] == "offline" and init_kw["dir"] == str(tmp_path) and init_kw["config"]["job"]["steps"] == 3
    assert ("wandb.log", {"train/loss": 1.5, "train/lr": 1e-3}, 3) in calls  # NaN grad norm left out
    assert ("wandb.log", {"eval/loss": 1.7}, 3) in calls
    assert ("tb", str(tmp_path / "tb")) in calls and ("tb.scalar", "eval/loss", 1.7, 3) in calls
    assert ("wandb.finish",) in calls and ("tb.close",) in calls


def test_report_to_accepts_hugging_face_spellings():
    assert JobSection(report_to="all").report_to == ["tensorboard", "wandb"]
    assert JobSection(report_to="none").report_to == []
    assert JobSection(report_to="wandb, tensorboard").report_to == ["wandb", "tensorboard"]
    assert JobSection().report_to is None
    with pytest.raises(ValidationError):
        JobSection(report_to="mlflow")
