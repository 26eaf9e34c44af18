"""`zeal launch`: the torchrun command it builds, and a 2-"node" run on this machine
(two torchrun agents meeting at a c10d rendezvous on 127.0.0.1) matching a 1-node run of
the same script on 2 ranks (started by the test harness: `zeal launch --nproc 2` on one
node is run by the failing-rank test below)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from zeal.cli.launch import parse_hostfile, torchrun_argv

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("launch_script.py")


def test_torchrun_argv_single_and_multi_node():
    one = torchrun_argv(2, ["train.py", "--lr", "1"])
    assert one[1:4] == ["-m", "torch.distributed.run", "--nproc-per-node=2"]
    assert "--standalone" in one and one[-3:] == ["train.py", "--lr", "1"]
    multi = torchrun_argv(4, ["-x"], nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=1234, module=True)
    assert "--nnodes=2" in multi and "--rdzv-backend=c10d" in multi and "--rdzv-endpoint=10.0.0.1:1234" in multi
    assert multi[-2:] == ["-m", "-x"] and "--standalone" not in multi
    static = torchrun_argv(1, ["s.py"], nnodes=2, node_rank=1, master_addr="h", rdzv_backend="static")
    assert "--node-rank=1" in static and "--master-addr=h" in static
    with pytest.raises(ValueError, match="--master-addr"):
        torchrun_argv(1, ["s.py"], nnodes=2)
    with pytest.raises(ValueError, match="--node-rank"):
        torchrun_argv(1, ["s.py"], nnodes=2, node_rank=2, master_addr="h")
    with pytest.raises(ValueError, match="nothing to launch"):
        torchrun_argv(1, [])


def test_hostfile():
    hosts = parse_hostfile("# cluster\nnode-a slots=4\nnode-b   # no slots\n\n")
    assert [(h.name, h.slots) for h in hosts] == [("node-a", 4), ("node-b", None)]
    with pytest.raises(ValueError, match="hostfile:1"):
        parse_hostfile("a slots=x")
    with pytest.raises(ValueError, match="twice"):
        parse_hostfile("a\na")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _zeal(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::FutureWarning")
    return subprocess.Popen([sys.executable, "-m", "zeal.cli.main", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(procs: list[subprocess.Popen], timeout: float = 150) -> None:
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("zeal launch hung")
        assert p.returncode == 0, out[-3000:]


def _script_on_rank(rank: int, world: int, out: str) -> None:
    """The launched script as one rank of a 1-node run (forked from the harness's warm server)."""
    import runpy

    sys.argv = [str(SCRIPT), out]
    runpy.run_path(str(SCRIPT), run_name="__main__")


@pytest.mark.timeout(180)
def test_two_nodes_match_one_node(tmp_path, capfd, monkeypatch):
    from tests.cli.in_process import zeal_here
    from tests.dist_harness import run_ranks

    one, two = tmp_path / "one.json", tmp_path / "two.json"
    run_ranks(_script_on_rank, 2, str(one), timeout=150)
    port = str(_free_port())
    node = ["launch", "--nproc", "1", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port,
            "--rdzv-id", "test", str(SCRIPT), str(two)]
    other = _zeal(*node[:3], "--node-rank", "1", *node[3:])  # node 1's `zeal launch`: a process
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    rc, out, err = zeal_here(capfd, monkeypatch, *node[:3], "--node-rank", "0", *node[3:])  # node 0's: here
    if rc != 0:
        other.kill()
    assert rc == 0, (out + err)[-3000:]
    _finish([other])
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert a["world"] == b["world"] == 2
    assert a["all_reduce"] == b["all_reduce"] == [0.0, 3.0, 6.0, 9.0]
    # Same global batch, same rank layout up to order: a 2-rank sum is commutative, so bitwise equal.
    assert a["losses"] == b["losses"] and a["param_sum"] == b["param_sum"]
    assert a["losses"][-1] < a["losses"][0]


def test_hostfile_dry_run(tmp_path, capsys):
    from zeal.cli.main import main

    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 slots=3\nnode-b slots=3\n")
    assert main(["launch", "--hostfile", str(hosts), "--dry-run", "train.py", "--lr", "1"]) == 0
    cmd = capsys.readouterr().out.split()
    assert "--nproc-per-node=3" in cmd and "--nnodes=2" in cmd and "--rdzv-endpoint=127.0.0.1:29500" in cmd
    assert cmd[-3:] == ["train.py", "--lr", "1"]
    assert main(["launch", "--hostfile", str(tmp_path / "none"), "x.py"]) == 2


@pytest.mark.timeout(120)
def test_failing_rank_reported_once_in_one_line(tmp_path, capfd, monkeypatch):
    from tests.cli.in_process import zeal_here

    script = tmp_path / "fails.py"
    script.write_text("import os, sys\nimport helper_mod\n"
                      "if os.environ['RANK'] == '1':\n    raise ValueError('bad shard ' + sys.argv[1])\n")
    (tmp_path / "helper_mod.py").write_text("")  # the script's folder is on sys.path, as under python
    logs = tmp_path / "logs"
    # the launcher runs in this process; torchrun and the two ranks are processes
    rc, out, err = zeal_here(capfd, monkeypatch, "launch", "--nproc", "2", "--log-dir", str(logs), str(script), "x7")
    out += err
    assert rc == 2, out
    lines = [ln for ln in out.splitlines() if "bad shard" in ln]
    assert lines == [f"zeal launch: error: rank 1: bad shard x7 (full log: {logs / 'rank1.log'})"], out
    assert "Traceback" not in out and "ChildFailedError" not in out, out
    assert "ValueError: bad shard x7" in (logs / "rank1.log").read_text()
