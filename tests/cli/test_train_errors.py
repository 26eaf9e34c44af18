"""`zeal train`'s failure and no-op paths: a rank's error is reported once, in one
line, with the path of its full log; `--resume` at or past `--steps` does nothing; a tracker that is not installed is skipped."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
from pathlib import Path

import pytest

from tests.cli.in_process import zeal_here
from zeal.cli.rank_errors import clear_rank_errors, first_rank_error, one_line, record_rank_error

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model", "gpt", "--data.max_bytes", "100000", "--data.vocab_size", "300", "--model.n_layer", "1", "--model.n_embd", "32",
        "--data.seq_len", "32", "--job.eval_batches", "1", "--job.sample_tokens", "0", "--job.eval_interval", "0"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("zeal-cache")
    return dict(os.environ, PYTHONPATH=str(ROOT), ZEAL_CACHE=str(cache), PYTHONWARNINGS="ignore::FutureWarning")


def test_first_rank_error_is_the_earliest(tmp_path):
    for rank, err in [(1, RuntimeError("Connection closed by peer")), (0, ValueError("bad\nvalue"))]:
        record_rank_error(tmp_path, rank, err)
    first = first_rank_error(tmp_path)
    assert (first["rank"], first["error"]) == (1, "RuntimeError: Connection closed by peer")
    assert "RuntimeError: Connection closed" in Path(first["log"]).read_text()
    assert one_line(ValueError("bad\n  value")) == "bad value"
    clear_rank_errors(tmp_path)
    assert first_rank_error(tmp_path) is None


@pytest.mark.timeout(300)
def test_rank_error_is_printed_once_with_its_log(env, tmp_path, capfd, monkeypatch):
    run = tmp_path / "run"
    # passes the launcher's validation (the config is well formed), fails in every rank when
    # the engine looks for the swap folder; the launcher runs here, its two ranks are processes
    missing = tmp_path / "no-such-folder"
    rc, out, err = zeal_here(capfd, monkeypatch, "train", "--nproc", "2", "--steps", "2", "--run-dir", str(run),
                             *TINY, "--zero-stage", "2", "--zero_optimization.offload_optimizer.device", "nvme",
                             "--zero_optimization.offload_optimizer.nvme_path", str(missing), cache=env["ZEAL_CACHE"])
    assert rc == 2, out + err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("zeal train: error: rank ") and "does not exist" in lines[0], lines[0]
    assert "Traceback" not in out + err and "ChildFailedError" not in out + err
    log = Path(lines[0].rsplit("(full log: ", 1)[1].rstrip(")"))
    assert log.parent == run / "logs" and "does not exist" in log.read_text()
    assert "Traceback" in log.read_text()


@pytest.mark.timeout(300)
def test_resume_at_or_past_steps_does_nothing(env, tmp_path, capfd, monkeypatch):
    run = tmp_path / "run"  # one process: the job runs here
    rc, out, err = zeal_here(capfd, monkeypatch, "train", "--nproc", "1", "--steps", "2", "--run-dir", str(run),
                             "--report-to", "wandb", *TINY, cache=env["ZEAL_CACHE"])
    assert rc == 0, out + err
    if importlib.util.find_spec("wandb") is None:  # the tracker is skipped with a message, training goes on
        assert "report_to wandb skipped" in out and "pip install wandb" in out, out
    rows = (run / "metrics.csv").read_text()
    summary = (run / "summary.json").read_text()
    for steps in ("2", "1"):
        rc, out, err = zeal_here(capfd, monkeypatch, "train", "--resume", "--nproc", "1", "--steps", steps,
                                 "--run-dir", str(run), *TINY, cache=env["ZEAL_CACHE"])
        assert rc == 0, out + err
        assert "already at step 2" in out and "nothing to do" in out, out
    assert (run / "metrics.csv").read_text() == rows and (run / "summary.json").read_text() == summary
    assert [row["kind"] for row in csv.DictReader((run / "metrics.csv").open())].count("eval") == 2
    assert json.loads(summary)["steps"] == 2
