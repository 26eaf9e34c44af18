"""`zeal deepspeed` takes every flag of DeepSpeed's launcher, so that DeepSpeedExamples'
run scripts (HelloDeepSpeed's ``deepspeed --bind_cores_to_rank train_bert_ds.py``) parse:
core binding and per-rank logs act as DeepSpeed's do, ``--autotuning`` is refused in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from zeal.cli.main import main
from zeal.deepspeed.__main__ import BIND_CORES, RANK_LOG_DIR, cores_of_rank

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def test_cores_are_shared_out_as_deepspeeds_launcher_does():
    assert cores_of_rank("0-7", 2, 0) == [0, 1, 2, 3] and cores_of_rank("0-7", 2, 1) == [4, 5, 6, 7]
    assert cores_of_rank("0,2,4-6", 2, 1) == [4, 5]  # 5 cores, 2 each, the fifth unused
    with pytest.raises(ValueError, match="each rank needs one"):
        cores_of_rank("0", 2, 0)
    with pytest.raises(ValueError, match="bind_core_list"):
        cores_of_rank("a-b", 1, 0)


def test_every_deepspeed_launcher_flag_parses(capsys, tmp_path):
    argv = ["deepspeed", "--bind_cores_to_rank", "--bind_core_list", "0", "--no_ssh", "--no_ssh_check",
            "--force_multi", "--launcher_args=-x", "--ssh_port", "22", "--venv_script", "v.sh", "--log_level",
            "warning", "-q", "--enable_each_rank_log", str(tmp_path / "logs"), "--dry_run", "train.py", "--x", "1"]
    assert main(argv) == 0
    assert capsys.readouterr().out.rstrip().endswith("zeal.deepspeed train.py --x 1")


def test_autotuning_is_refused_in_one_line(capsys):
    assert main(["deepspeed", "--autotuning", "run", "train.py"]) != 0
    err = capsys.readouterr().err
    assert "--autotuning run: zeal has no autotuner" in err and "Traceback" not in err


def test_a_rank_is_bound_to_its_cores_and_logs_to_its_file(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text("import os, torch\nprint(sorted(os.sched_getaffinity(0)), torch.get_num_threads(), "
                      "os.environ['OMP_NUM_THREADS'])\n")
    core = sorted(os.sched_getaffinity(0))[-1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), BIND_CORES: str(core), RANK_LOG_DIR: str(tmp_path),
           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "RANK": "0"}
    out = subprocess.run([sys.executable, "-m", "zeal.deepspeed", str(script)], env=env, capture_output=True,
                         text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == ""  # went to the rank's log
    assert (tmp_path / "rank0.log").read_text().strip() == f"[{core}] 1 1"
