"""``bench/gpu/run.sh --dry-run``: the GPU check's stages run on the CPU at toy sizes, so the
script is ready (and still right) on the day a GPU is lent. One run serves both tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """``run.sh --dry-run``'s output folder and its completed process."""
    out = tmp_path_factory.mktemp("gpu-dry-run")
    env = os.environ | {"OUT": str(out), "PYTHON": sys.executable}
    if os.environ.get("PYTEST_XDIST_WORKER"):  # one core per worker (tests/conftest.py), its stages too
        env |= {"OMP_NUM_THREADS": "1"}
    r = subprocess.run(["bash", str(REPO / "bench/gpu/run.sh"), "--dry-run"], env=env, capture_output=True, text=True,
                       timeout=380)
    return out, r


@pytest.mark.timeout(400)
def test_gpu_check_dry_run(dry_run):
    tmp_path, r = dry_run
    assert r.returncode == 0, r.stderr[-2000:]
    recs = {x["stage"]: x for x in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines())}
    assert set(recs) == {"env", "train_correct", "train_speed", "serve_correct", "serve_speed"}, recs
    assert not [r for r in recs.values() if "error" in r], recs
    assert recs["env"]["smoke_step"]["ok"], recs["env"]
    bad = {k: v for k, v in recs["train_correct"]["cases"].items() if not v["ok"]}
    assert not bad, bad
    runs = recs["train_speed"]["runs"]
    assert all(v.get("tokens_per_s", 0) > 0 for k, v in runs.items() if "compiled" not in k), runs
    assert recs["serve_correct"]["fp32_greedy_equal"] == "4/4"
    assert recs["serve_correct"]["flex_path_greedy_equal"] == "4/4"  # the accelerator's serving path, on CPU
    assert recs["serve_speed"]["zeal_decode_step_ms_at_batch"] > 0
    assert recs["serve_correct"]["bf16_prompt_logprob_max_abs_diff"] < 0.1
    assert recs["serve_speed"]["zeal_tokens_per_s"] > 0 and recs["serve_speed"]["hf_generate_tokens_per_s"] > 0
    assert "== serve_speed" in r.stdout  # the report table


@pytest.mark.timeout(400)
def test_train_speed_prints_its_record_after_each_run(dry_run):
    """Each run prints the stage's record so far, so a stage that ``run.sh`` stops at its time
    limit (it keeps a stage's last line) still reports the runs it measured; the compiled runs,
    the slowest to start, come last."""
    out, r = dry_run
    assert r.returncode == 0, r.stderr[-2000:]
    recs = [json.loads(x) for x in (out / "train_speed.out").read_text().splitlines() if x.startswith("{")]
    *partial, final = recs
    assert all(p["partial"] for p in partial) and "partial" not in final, recs
    names = list(final["runs"])
    measured = [n for n in names if "skipped" not in final["runs"][n]]  # the dry run skips the compiled ones
    assert len(measured) >= 4, final["runs"]
    assert [list(p["runs"]) for p in partial] == [names[:names.index(m) + 1] for m in measured]
    assert all(p["runs"][m] == final["runs"][m] for p in partial for m in p["runs"])
    compiled = [i for i, n in enumerate(names) if "compiled" in n]
    assert compiled == list(range(len(names) - len(compiled), len(names))), names  # the compiled runs last
    assert final["params"] == partial[0]["params"] > 0


def test_a_stage_past_its_limit_keeps_its_last_record(tmp_path, monkeypatch):
    """The forked runner's time limit: a stage still running at its limit is stopped, and the
    last record it printed is its line; one that printed none gets a line saying so."""
    monkeypatch.syspath_prepend(str(REPO / "bench/gpu"))
    import forked
    import stages

    def slow(dry):
        stages._partial("slow", dry, {"runs": {"a": 1}})
        import time
        time.sleep(60)
        return {"runs": {"a": 1, "b": 2}}

    monkeypatch.setitem(stages.STAGES, "slow", slow)
    monkeypatch.setattr(forked, "GRACE_S", 0.5)
    line = json.loads(forked.run_stage("slow", 1.0, tmp_path))
    assert line["partial"] and line["runs"] == {"a": 1}, line
    monkeypatch.setitem(stages.STAGES, "slow", lambda dry: __import__("time").sleep(60))
    line = json.loads(forked.run_stage("slow", 0.5, tmp_path))
    assert line["stage"] == "slow" and line["error"].startswith("no result"), line
