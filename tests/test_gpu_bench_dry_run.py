"""``bench/gpu/run.sh --dry-run``: the GPU check's stages run on the CPU at toy sizes, so the
script is ready (and still right) on the day a GPU is lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(400)
def test_gpu_check_dry_run(tmp_path):
    env = os.environ | {"OUT": str(tmp_path), "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(REPO / "bench/gpu/run.sh"), "--dry-run"], env=env, capture_output=True, text=True,
                       timeout=380)
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
