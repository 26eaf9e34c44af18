"""``bench/gpu/stages.py train_speed``: each run prints the stage's record so far, so a stage
that ``run.sh`` stops at its time limit (it keeps a stage's last line) still reports the runs
it measured; the compiled runs, the slowest to start, come last."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_train_speed_prints_its_record_after_each_run():
    r = subprocess.run([sys.executable, str(REPO / "bench/gpu/stages.py"), "train_speed", "--dry-run"],
                       capture_output=True, text=True, timeout=110)
    assert r.returncode == 0, r.stderr[-2000:]
    recs = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
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
