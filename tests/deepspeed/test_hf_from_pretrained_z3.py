"""``from_pretrained`` under a ZeRO-3 DeepSpeed config (HfDeepSpeedConfig: transformers builds
the model inside ``deepspeed.zero.Init`` and writes the checkpoint through
``GatheredParameters(modifier_rank=0)``, rank 0 reading, the others receiving), in an
unchanged script under the switch: every rank holds the saved weights exactly, and the first
loss equals the reference model's. It failed at transformers' ``prevent_arange_dtype_change``
and then at ``GatheredParameters`` on meta parameters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_harness import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "hf_from_pretrained_z3.py"


@pytest.mark.timeout(300)
# one rank reads and keeps every weight: the long tier; two ranks (rank 0 reading, rank 1 receiving) run
# the same zeal lines and more, in the default tier
@pytest.mark.parametrize("ranks", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_from_pretrained_under_zero3_loads_the_checkpoint_on_every_rank(tmp_path, ranks):
    from zeal.deepspeed.switch import site_dir

    env = {k: v for k, v in os.environ.items() if k not in ("ZEAL_DEEPSPEED", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(ZEAL_DEEPSPEED="1", PYTHONPATH=site_dir() + os.pathsep + str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
           str(free_port()), str(SCRIPT), "--out", str(tmp_path / "model")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280, cwd=str(tmp_path))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    results = [json.loads((tmp_path / f"model-result-{r}.json").read_text()) for r in range(ranks)]
    assert len(results) == ranks
    for r in results:
        assert r["same_weights"] and r["keys"] == 21, r
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-6), r
