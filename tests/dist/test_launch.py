"""The launcher (zeal/dist/launch.py), the one way every command starts ranks: a rank that
raises is named in one line; a hang ends with the hang-forensics report naming the rank
that skipped a collective; a launch past its time limit is ended (status 124) with each
rank's last records. Two ranks, each a script under ``zeal.dist.rank_main``, started by the
launching process itself (one node: no torchrun agent, zeal/dist/local_ranks.py); their
environment is checked against a real torchrun launch's, and a multi-node or restarting
launch still goes through torchrun.

The time-limit launch spends most of its time waiting for its limit: it runs in a launcher
process of its own (stderr piped, as a terminal would get it), started with the module,
beside the other launches.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zeal.dist.launch import (
    RANK_MAIN,
    TIMEOUT_STATUS,
    child_env,
    launch_ranks,
    rank_env,
    run_torchrun,
    torchrun_argv,
)
from zeal.dist.local_ranks import LOG_NAME, LocalLaunch, local_launch

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
    return _launcher(code), tmp_path / "logs"


def _launcher(code: str) -> subprocess.Popen:
    """``python -c code`` from the checkout, with zeal importable; its stderr piped."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


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


# ---- the single-node launch without torchrun (zeal/dist/local_ranks.py) ----------------------

ENV_DUMP = """
import json, os, sys
keep = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME",
        "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "PYTHONPATH")
env = {k: v for k, v in os.environ.items() if k in keep or k.startswith(("TORCHELASTIC_", "TORCH_NCCL"))}
rec = {"env": env, "orig_argv": sys.orig_argv[1:], "argv": sys.argv, "cwd": os.getcwd()}
with open(os.path.join(sys.argv[1], "rank" + os.environ["RANK"] + ".json"), "w") as f:
    json.dump(rec, f)
"""
AGENT_ONLY = {"TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_SIGNALS_TO_HANDLE"}
PER_LAUNCH = {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"}  # the rendezvous point, the run's id

# rank 0 fails at once (the statement given); rank 1 starts a child and sleeps, both write their pids
FAILS_FIRST = """
import os, subprocess, sys, time
out = sys.argv[1]
if os.environ["RANK"] == "0":
    while not os.path.exists(os.path.join(out, "child")):
        time.sleep(0.02)
    {fail}
child = subprocess.Popen(["sleep", "120"])
for name, pid in (("rank1", os.getpid()), ("child", child.pid)):
    with open(os.path.join(out, name + ".tmp"), "w") as f:
        f.write(str(pid))
    os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))
time.sleep(120)
"""


def _gone(pid: int, within_s: float = 5.0) -> bool:
    """The process has exited (gone, or a zombie waiting for its reaper) within ``within_s``."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def _direct(tmp_path: Path, source: str, timeout_s: float | None = 60) -> int:
    """``source`` on 2 ranks of this node through :func:`run_torchrun` (the single-node path)."""
    script = tmp_path / "job.py"
    script.write_text(source)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    return run_torchrun(torchrun_argv(2, [RANK_MAIN, str(script), str(out)], module=True), 2, prog="zeal test",
                        log_dir=tmp_path / "logs", timeout_s=timeout_s)


@pytest.mark.timeout(120)
def test_direct_ranks_get_torchruns_environment_and_command(tmp_path):
    """Reference: the same script under real torchrun (standalone, 2 ranks)."""
    script, out = tmp_path / "dump.py", tmp_path / "out"
    script.write_text(ENV_DUMP)
    out.mkdir()
    subprocess.run(torchrun_argv(2, [str(script), str(out)]), env=child_env(2), check=True, timeout=90,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    want = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank in (0, 1):
        (out / f"rank{rank}.json").unlink()
    assert run_torchrun(torchrun_argv(2, [str(script), str(out)]), 2, prog="zeal test", log_dir=tmp_path / "logs") == 0
    assert not (tmp_path / "logs" / "torchrun.log").exists()  # no torchrun ran
    recs = []
    for rank in (0, 1):
        got = json.loads((out / f"rank{rank}.json").read_text())
        assert "TORCHELASTIC_USE_AGENT_STORE" not in got["env"]  # rank 0 hosts the store, as with env://
        assert set(got["env"]) == set(want[rank]["env"]) - AGENT_ONLY
        assert {k: v for k, v in got["env"].items() if k not in PER_LAUNCH} == \
            {k: v for k, v in want[rank]["env"].items() if k not in PER_LAUNCH | AGENT_ONLY}
        assert [got[k] for k in ("orig_argv", "argv", "cwd")] == [want[rank][k] for k in ("orig_argv", "argv", "cwd")]
        recs.append(got["env"])
    assert recs[0]["MASTER_ADDR"] == recs[1]["MASTER_ADDR"] == "127.0.0.1"
    assert recs[0]["MASTER_PORT"] == recs[1]["MASTER_PORT"] and recs[0]["TORCHELASTIC_RUN_ID"] == recs[1][
        "TORCHELASTIC_RUN_ID"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("fail", "status", "logged"), [("sys.exit(3)", 3, "exit status 3"),
                                                        ("os.kill(os.getpid(), 9)", 1, "ended by signal SIGKILL")])
def test_a_failing_rank_ends_the_others_and_its_status_is_the_launchs(tmp_path, capfd, fail, status, logged):
    start = time.monotonic()
    assert _direct(tmp_path, FAILS_FIRST.replace("{fail}", fail)) == status
    assert time.monotonic() - start < 20  # not the sleeping rank's 120 s, nor the 60 s limit
    out = tmp_path / "out"
    assert _gone(int((out / "rank1").read_text())) and _gone(int((out / "child").read_text()))
    logs = tmp_path / "logs"
    assert capfd.readouterr().err.strip().splitlines()[-1] == \
        f"zeal test: error: the ranks failed (exit status {status}); see {logs / LOG_NAME}"
    assert f"rank 0 failed first ({logged})" in (logs / LOG_NAME).read_text()


@pytest.mark.timeout(90)
def test_the_time_limit_ends_every_rank_with_status_124(tmp_path, capfd):
    start = time.monotonic()
    assert _direct(tmp_path, FAILS_FIRST.replace("{fail}", "time.sleep(120)"), timeout_s=4) == TIMEOUT_STATUS
    assert time.monotonic() - start < 15
    out = tmp_path / "out"
    assert _gone(int((out / "rank1").read_text())) and _gone(int((out / "child").read_text()))
    assert capfd.readouterr().err.strip().splitlines()[-1] == (
        f"zeal test: error: the ranks did not finish within 4 s (--timeout); their logs: {tmp_path / 'logs'}")


@pytest.mark.timeout(90)
def test_sigterm_to_the_launcher_ends_its_ranks(tmp_path):
    script, out = tmp_path / "job.py", tmp_path / "out"
    script.write_text(FAILS_FIRST.replace("{fail}", "time.sleep(120)"))
    out.mkdir()
    code = ("import sys\nfrom zeal.dist.launch import RANK_MAIN, run_torchrun, torchrun_argv\n"
            f"sys.exit(run_torchrun(torchrun_argv(2, [RANK_MAIN, {str(script)!r}, {str(out)!r}], module=True), 2, "
            f"prog='zeal test', log_dir={str(tmp_path / 'logs')!r}))")
    proc = _launcher(code)
    end = time.monotonic() + 60
    while not (out / "child").exists() and time.monotonic() < end:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM
    assert _gone(int((out / "rank1").read_text())) and _gone(int((out / "child").read_text()))
    assert "ending the ranks" in (tmp_path / "logs" / LOG_NAME).read_text()


def test_only_a_single_node_launch_without_restarts_skips_torchrun(monkeypatch, tmp_path):
    exe = sys.executable
    assert local_launch(torchrun_argv(2, ["s.py", "a"])) == LocalLaunch(2, [exe, "-u", "s.py", "a"])
    assert local_launch(torchrun_argv(3, ["m", "-x"], module=True, runner="zeal.dist.quiet_torchrun")) == \
        LocalLaunch(3, [exe, "-u", "-m", "m", "-x"])
    # zeal deepspeed's one node: a static rendezvous at the address and port given
    assert local_launch(torchrun_argv(2, ["s.py"], master_addr="127.0.0.1", master_port=29123, node_rank=0,
                                      rdzv_backend="static")) == LocalLaunch(2, [exe, "-u", "s.py"], "127.0.0.1", 29123)
    torchrun_runs = [torchrun_argv(2, ["s.py"], nnodes=2, node_rank=0, master_addr="h"),  # c10d
                     torchrun_argv(2, ["s.py"], nnodes=2, node_rank=1, master_addr="h", rdzv_backend="static"),
                     torchrun_argv(2, ["s.py"], master_addr="h"),  # c10d rendezvous others may join
                     torchrun_argv(2, ["s.py"], max_restarts=2)]
    assert [local_launch(a) for a in torchrun_runs] == [None] * 4
    ran = []
    monkeypatch.setattr("zeal.dist.launch._run_torchrun", lambda argv, env, timeout_s: (ran.append(argv) or (0, False)))
    for argv in torchrun_runs:
        assert run_torchrun(argv, 2, prog="zeal test", log_dir=tmp_path) == 0
    assert ran == torchrun_runs
