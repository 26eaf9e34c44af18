"""`zeal train`'s failure and no-op paths: a rank's error is reported once, in one
line, with the path of its full log; `--resume` at or past `--steps` does nothing; a tracker that is not installed is skipped."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zeal.cli.rank_errors import clear_rank_errors, first_rank_error, one_line, record_rank_error

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model", "gpt", "--data.max_bytes", "100000", "--data.vocab_size", "300", "--model.n_layer", "1", "--model.n_embd", "32",
        "--data.seq_len", "32", "--job.eval_batches", "1", "--job.sample_tokens", "0", "--job.eval_interval", "0"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("zeal-cache")
    return dict(os.environ, PYTHONPATH=str(ROOT), ZEAL_CACHE=str(cache), PYTHONWARNINGS="ignore::FutureWarning")


def zeal(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zeal.cli.main", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)


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
def test_rank_error_is_printed_once_with_its_log(env, tmp_path):
    run = tmp_path / "run"
    # passes the launcher's validation (the config is well formed), fails in every rank when
    # the engine looks for the swap folder
    missing = tmp_path / "no-such-folder"
    r = zeal(env, "train", "--nproc", "2", "--steps", "2", "--run-dir", str(run), *TINY, "--zero-stage", "2",
             "--zero_optimization.offload_optimizer.device", "nvme",
             "--zero_optimization.offload_optimizer.nvme_path", str(missing))
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("zeal train: error: rank ") and "does not exist" in lines[0], lines[0]
    assert "Traceback" not in r.stdout + r.stderr and "ChildFailedError" not in r.stdout + r.stderr
    log = Path(lines[0].rsplit("(full log: ", 1)[1].rstrip(")"))
    assert log.parent == run / "logs" and "does not exist" in log.read_text()
    assert "Traceback" in log.read_text()


@pytest.mark.timeout(300)
def test_resume_at_or_past_steps_does_nothing(env, tmp_path):
    run = tmp_path / "run"
    r = zeal(env, "train", "--nproc", "1", "--steps", "2", "--run-dir", str(run), "--report-to", "wandb", *TINY)
    assert r.returncode == 0, r.stdout + r.stderr
    if importlib.util.find_spec("wandb") is None:  # the tracker is skipped with a message, training goes on
        assert "report_to wandb skipped" in r.stdout and "pip install wandb" in r.stdout, r.stdout
    rows = (run / "metrics.csv").read_text()
    summary = (run / "summary.json").read_text()
    for steps in ("2", "1"):
        r = zeal(env, "train", "--resume", "--nproc", "1", "--steps", steps, "--run-dir", str(run), *TINY)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "already at step 2" in r.stdout and "nothing to do" in r.stdout, r.stdout
    assert (run / "metrics.csv").read_text() == rows and (run / "summary.json").read_text() == summary
    assert [row["kind"] for row in csv.DictReader((run / "metrics.csv").open())].count("eval") == 2
    assert json.loads(summary)["steps"] == 2
