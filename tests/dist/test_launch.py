"""The launcher (zeal/dist/launch.py), the one way every command starts ranks: a rank that
raises is named in one line; a hang ends with the hang-forensics report naming the rank
that skipped a collective; a launch past its time limit is ended (status 124) with each
rank's last records. Real torchrun, two ranks, each a script under ``zeal.dist.rank_main``.

The time-limit launch spends most of its time waiting for its limit: it runs in a launcher
process of its own (stderr piped, as a terminal would get it), started with the module,
beside the other launches.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from zeal.dist.launch import RANK_MAIN, TIMEOUT_STATUS, launch_ranks, rank_env, torchrun_argv

RAISES = """
import os
if os.environ["RANK"] == "1":
    raise ValueError("bad shard 7")
"""

# rank 1 skips the third all-reduce; both wait for the collective timeout, then fail
SKIPS = """
import os, time
import torch
from zeal.dist.comm import Comm
from zeal.dist.context import init_distributed

ctx = init_distributed()
world = Comm(ctx, name="world")
for _ in range(2):
    world.all_reduce(torch.ones(4), "grad")
if ctx.rank == 0:
    world.all_reduce(torch.ones(3), "grad")  # SKIPPED BY RANK 1
time.sleep(0.5)
world.all_reduce(torch.ones(4), "grad")
"""

SLEEPS = """
import os, time
if os.environ["RANK"] == "1":
    time.sleep(120)
"""


ROOT = Path(__file__).resolve().parents[2]
LIMIT_S = 8  # the time-limit launch's; it starts beside the other launches


def _launch(tmp_path, source: str, **kw) -> int:
    script = tmp_path / "job.py"
    script.write_text(source)
    return launch_ranks([RANK_MAIN, str(script)], 2, prog="zeal test", log_dir=tmp_path / "logs", **kw)


def _start(tmp_path: Path, source: str, **kw) -> tuple[subprocess.Popen, Path]:
    """``_launch`` in a launcher process of its own; returns it and its log folder."""
    script = tmp_path / "job.py"
    script.write_text(source)
    code = ("import sys\nfrom zeal.dist.launch import RANK_MAIN, launch_ranks\n"
            f"sys.exit(launch_ranks([RANK_MAIN, {str(script)!r}], 2, prog='zeal test', "
            f"log_dir={str(tmp_path / 'logs')!r}, **{kw!r}))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    return proc, tmp_path / "logs"


@pytest.fixture(scope="module", autouse=True)
def limit_launch(tmp_path_factory):
    """The time-limit launch, started when the module starts (it ends by itself, at its limit)."""
    proc, logs = _start(tmp_path_factory.mktemp("limit"), SLEEPS, timeout_s=LIMIT_S)
    yield proc, logs
    try:
        proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def test_rank_env_and_argv():
    assert rank_env(3, 4, 1234, local_world=2, threads=1) == {
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    argv = torchrun_argv(2, ["m", "x"], module=True, runner="zeal.dist.quiet_torchrun")
    assert argv[1:] == ["-m", "zeal.dist.quiet_torchrun", "--nproc-per-node=2", "--standalone", "-m", "m", "x"]


@pytest.mark.timeout(90)
def test_a_rank_that_raises_is_named_in_one_line(tmp_path, capfd):
    assert _launch(tmp_path, RAISES, timeout_s=60) == 2
    err = capfd.readouterr().err
    logs = tmp_path / "logs"
    assert err.strip().splitlines() == [f"zeal test: error: rank 1: bad shard 7 (full log: {logs / 'rank1.log'})"]
    assert "ValueError: bad shard 7" in (logs / "rank1.log").read_text()


@pytest.mark.timeout(120)
def test_a_hang_ends_with_the_forensics_report(tmp_path, capfd):
    assert _launch(tmp_path, SKIPS, comm_timeout_s=3, timeout_s=90) != 0
    err = capfd.readouterr().err
    assert "hang forensics: records of ranks [0, 1]" in err, err
    assert "first divergence: group world [0, 1] position 2: all_reduce (3,)" in err, err
    assert "skipped by rank(s) [1]" in err, err
    assert err.strip().splitlines()[-1].startswith("zeal test: error: rank "), err


@pytest.mark.timeout(120)
def test_a_launch_past_its_time_limit_is_ended_with_each_ranks_records(limit_launch):
    proc, logs = limit_launch
    _, err = proc.communicate(timeout=100)
    assert proc.returncode == TIMEOUT_STATUS, err
    assert "rank 1: the launch's time limit ran out" in err, err
    assert err.strip().splitlines()[-1] == (f"zeal test: error: the ranks did not finish within {LIMIT_S} s "
                                            f"(--timeout); their logs: {logs}"), err
