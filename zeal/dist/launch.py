"""One way to start ranks: the environment they get, the rendezvous, the time limits, and
what the launching process prints when they fail.

Two shapes of launch, one set of rules:

- **A job of N ranks** (``zeal launch``, ``zeal train``, ``zeal rlhf``, ``zeal deepspeed``):
  :func:`launch_ranks` builds :func:`torchrun_argv`'s command and :func:`child_env`'s
  environment. On one node with no restarts the launching process starts the ranks itself
  with torchrun's variables (:mod:`zeal.dist.local_ranks`, its log ``LOGS/launcher.log``):
  no torchrun agent process. Several nodes (c10d or static rendezvous) or ``--max-restarts``
  run ``python -m zeal.dist.quiet_torchrun`` (torchrun, its own log sent to
  ``LOGS/torchrun.log``). Every rank runs its work under :func:`run_rank` (or
  ``python -m zeal.dist.rank_main`` for a user's script): a failure is recorded as
  ``LOGS/rankN.{log,json}`` (:mod:`zeal.dist.rank_errors`) and a collective that times out
  leaves ``LOGS/collectives-rankN.json`` (:mod:`zeal.dist.forensics`). When the ranks fail,
  the launcher prints the hang-forensics report (when any rank left records) and then one
  line naming the first failing rank, its error and its full log.
- **Helper ranks this process joins as rank 0** (tensor-parallel serving, the test harness,
  benchmarks): :func:`free_port` and :func:`rank_env` give each started process torchrun's
  variables for a loopback rendezvous.

Time limits: ``comm_timeout_s`` bounds one collective (``ZEAL_COMM_TIMEOUT_S`` in the ranks;
the process group fails, the rank dumps its records and exits). ``timeout_s`` bounds the
whole launch: shortly before it runs out every rank dumps its records (a watchdog thread
started by :func:`run_rank` / ``rank_main``, so a rank stuck inside a collective still
writes them), then the launcher ends the ranks and prints the report, exit status 124.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from zeal.dist.local_ranks import LOG_NAME, local_launch, run_local
from zeal.dist.rank_errors import clear_rank_errors, exit_status, failure_line, record_rank_error

T = TypeVar("T")
RUNNER = "zeal.dist.quiet_torchrun"
"""The torchrun module a multi-node launch uses (torchrun without its console report)."""
RANK_MAIN = "zeal.dist.rank_main"
"""The module a rank runs a user's script (or ``-m`` module) under."""
ENV_LOG_DIR = "ZEAL_RANK_LOG_DIR"
ENV_TORCHRUN_LOG = "ZEAL_TORCHRUN_LOG"
ENV_DEADLINE = "ZEAL_LAUNCH_DEADLINE"
DUMP_LEAD_S = 2.0  # the ranks dump their records this long before the launcher ends them
TIMEOUT_STATUS = 124  # as timeout(1)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (for a loopback rendezvous)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, *, local_world: int | None = None, threads: int | None = None,
             addr: str = "127.0.0.1") -> dict[str, str]:
    """torchrun's variables for rank ``rank`` of ``world`` meeting at ``addr:port``
    (``local_world``: ranks per node, default all; ``threads``: OMP_NUM_THREADS, if given)."""
    local = local_world or world
    env = {"MASTER_ADDR": addr, "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world),
           "LOCAL_RANK": str(rank % local), "LOCAL_WORLD_SIZE": str(local)}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def in_launched_rank() -> bool:
    """True inside a rank started by torchrun (or given torchrun's variables)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_argv(nproc: int, program: list[str], *, nnodes: int = 1, node_rank: int | None = None,
                  master_addr: str | None = None, master_port: int = 29500, rdzv_id: str = "zeal",
                  rdzv_backend: str = "c10d", module: bool = False, max_restarts: int = 0,
                  runner: str = "torch.distributed.run") -> list[str]:
    """The ``python -m torch.distributed.run`` command line for a launch (``runner``:
    another module taking torchrun's arguments, such as :data:`RUNNER`).

    Multi-node runs use the c10d rendezvous by default (ranks are assigned in
    arrival order; ``node_rank`` is only checked); ``rdzv_backend="static"`` uses
    ``node_rank`` as given, for a fixed rank layout."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if nnodes < 1:
        raise ValueError(f"--nnodes must be >= 1, got {nnodes}")
    if not program:
        raise ValueError("nothing to launch: give a script (or -m module) and its arguments")
    argv = [sys.executable, "-m", runner, f"--nproc-per-node={nproc}"]
    if nnodes == 1 and master_addr is None:
        argv.append("--standalone")
    else:
        if master_addr is None:
            raise ValueError("--nnodes > 1 needs --master-addr (or --hostfile)")
        if node_rank is not None and not 0 <= node_rank < nnodes:
            raise ValueError(f"--node-rank must be in [0, {nnodes}), got {node_rank}")
        if rdzv_backend == "c10d":
            argv += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={master_addr}:{master_port}",
                     f"--rdzv-id={rdzv_id}"]
        elif rdzv_backend == "static":
            if node_rank is None:
                raise ValueError("--rdzv-backend static needs --node-rank")
            argv += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--master-addr={master_addr}",
                     f"--master-port={master_port}"]
        else:
            raise ValueError(f"--rdzv-backend must be c10d or static, got {rdzv_backend!r}")
    if max_restarts:
        argv.append(f"--max-restarts={max_restarts}")
    if module:
        argv.append("-m")
    return argv + list(program)


def child_env(nproc: int) -> dict[str, str]:
    """Environment for launched ranks: zeal importable from this checkout, and one
    share of the CPU cores per rank unless OMP_NUM_THREADS is already set."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return env


def launch_ranks(program: list[str], nproc: int, *, prog: str, log_dir: str | os.PathLike | None = None,
                 env: dict[str, str] | None = None, timeout_s: float | None = None,
                 comm_timeout_s: float | None = None, **rendezvous) -> int:
    """Run ``python -m MODULE ARGS`` (``program``, a module and its arguments) on ``nproc``
    ranks of this node (started by this process on one node, by torchrun on several); returns
    the exit status (0, the first failed rank's, or :data:`TIMEOUT_STATUS`). ``rendezvous``:
    :func:`torchrun_argv`'s node keywords.

    The ranks' records go to ``log_dir`` (default: a temporary folder, removed after a
    successful run). On failure ``prog`` (``"zeal train"``) prefixes the one line printed to
    stderr, after the hang-forensics report when any rank left collective records.
    ``env``: extra variables for the ranks; ``timeout_s``: the whole launch's limit;
    ``comm_timeout_s``: one collective's (see the module docstring)."""
    argv = torchrun_argv(nproc, program, module=True, runner=RUNNER, **rendezvous)
    return run_torchrun(argv, nproc, prog=prog, log_dir=log_dir, env=env, timeout_s=timeout_s,
                        comm_timeout_s=comm_timeout_s)


def run_torchrun(argv: list[str], nproc: int, *, prog: str, log_dir: str | os.PathLike | None = None,
                 env: dict[str, str] | None = None, timeout_s: float | None = None,
                 comm_timeout_s: float | None = None) -> int:
    """Run a ready :func:`torchrun_argv` command line (``runner`` :data:`RUNNER`) with the
    launch rules of :func:`launch_ranks` (which builds the command and calls this). A
    single-node standalone command (:func:`zeal.dist.local_ranks.local_launch`) starts its
    ranks from this process, without torchrun; any other runs torchrun."""
    logs = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="zeal-launch-"))
    logs.mkdir(parents=True, exist_ok=True)
    clear_rank_errors(logs)
    child = child_env(nproc)
    child.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")  # torch's deprecation notices, once per rank
    child.update(env or {})
    child[ENV_LOG_DIR] = str(logs)
    child["ZEAL_FORENSICS_DIR"] = str(logs)  # where a rank whose collective timed out leaves its records
    if comm_timeout_s is not None:
        child["ZEAL_COMM_TIMEOUT_S"] = str(comm_timeout_s)
    if timeout_s is not None:
        child[ENV_DEADLINE] = str(time.time() + timeout_s)
    local = local_launch(argv)
    if local is not None:  # one node, no restarts: this process starts the ranks (zeal.dist.local_ranks)
        port = local.master_port if local.master_port is not None else free_port(local.master_addr)
        status = run_local(local, child, logs, port, timeout_s)
        rc, timed_out = (TIMEOUT_STATUS, True) if status is None else (status, False)
    else:
        child[ENV_TORCHRUN_LOG] = str(logs / "torchrun.log")
        rc, timed_out = _run_torchrun(argv, child, timeout_s)
    if rc != 0:
        launch_log = logs / (LOG_NAME if local is not None else "torchrun.log")
        print(failure_report(logs, rc, prog, timeout_s if timed_out else None, launch_log), file=sys.stderr)
    elif log_dir is None:
        shutil.rmtree(logs, ignore_errors=True)
    return rc


def _run_torchrun(argv: list[str], env: dict[str, str], timeout_s: float | None) -> tuple[int, bool]:
    """Run the torchrun command; (its exit status, whether ``timeout_s`` ran out)."""
    proc = subprocess.Popen(argv, env=env, start_new_session=timeout_s is not None)
    try:
        return proc.wait(timeout=timeout_s), False
    except subprocess.TimeoutExpired:
        _end(proc)
        return TIMEOUT_STATUS, True
    except BaseException:  # Ctrl-C: the ranks go with us
        _end(proc)
        raise


def _end(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM torchrun and its ranks (their own session when a time limit was set), then SIGKILL."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
        proc.wait()


def failure_report(log_dir: str | os.PathLike, rc: int, prog: str, timed_out_after: float | None = None,
                   launch_log: str | os.PathLike | None = None) -> str:
    """What a launcher prints after its ranks failed: the hang-forensics report when any
    rank left collective records, then one line (the first rank's error, or the time limit;
    with no rank's record, the exit status and ``launch_log``, default ``LOGS/torchrun.log``)."""
    logs = Path(log_dir)
    lines = []
    if any(logs.glob("collectives-rank*.json")):
        from zeal.dist.forensics import report

        lines.append(report(logs))
    if timed_out_after is not None:
        lines.append(f"{prog}: error: the ranks did not finish within {timed_out_after:g} s "
                     f"(--timeout); their logs: {logs}")
    else:
        lines.append(failure_line(logs, rc, prog, launch_log if launch_log is not None else logs / "torchrun.log"))
    return "\n".join(lines)


def run_rank(work: Callable[[], T], log_dir: str | os.PathLike | None = None) -> T:
    """This rank's ``work()``; a failure is recorded for the launcher (in ``log_dir``, default
    ``$ZEAL_RANK_LOG_DIR``) and ends the rank with its exit status instead of a traceback.
    Also arms the launch's deadline watchdog (see the module docstring)."""
    folder = log_dir if log_dir is not None else os.environ.get(ENV_LOG_DIR)
    watch_deadline()
    try:
        return work()
    except Exception as e:  # noqa: BLE001 - any failure is this rank's to record
        if not folder:
            raise
        record_rank_error(folder, int(os.environ.get("RANK", "0")), e)
        raise SystemExit(exit_status(e)) from None


def watch_deadline() -> threading.Thread | None:
    """In a launched rank with a time limit (``$ZEAL_LAUNCH_DEADLINE``): a daemon thread that
    dumps this rank's collective records :data:`DUMP_LEAD_S` before the launcher ends it."""
    raw = os.environ.get(ENV_DEADLINE)
    if not raw:
        return None
    deadline = float(raw)

    def dump() -> None:
        time.sleep(max(0.0, deadline - DUMP_LEAD_S - time.time()))
        from zeal.dist import forensics

        if forensics.LOG.dumped is None:
            forensics.LOG.rank = int(os.environ.get("RANK", forensics.LOG.rank))
            try:
                forensics.LOG.dump("the launch's time limit ran out while this rank was running")
            except OSError:
                pass

    t = threading.Thread(target=dump, name="zeal-launch-deadline", daemon=True)
    t.start()
    return t
