"""A single-node launch without torchrun: the launching process starts its ranks itself.

torchrun's elastic agent is one more Python process per launch (it imports torch and
torch.distributed.elastic: about 1.5 s of CPU) whose work, on one node with no restarts, is
to start N processes with the right variables and end them all when one fails. DeepSpeed's
single-node launcher does that itself, and so does :func:`run_local` for a launch whose
:func:`zeal.dist.launch.torchrun_argv` command is standalone (one node, no ``--master-addr``),
or a static rendezvous of one node (``zeal deepspeed``'s) and has no ``--max-restarts``
(:func:`local_launch` reads that from the command). Multi-node and restarting launches keep
torchrun.

What each rank gets is what torchrun gives it (:func:`local_rank_env`), except
``TORCHELASTIC_USE_AGENT_STORE``: there is no agent store, rank 0 hosts the TCPStore at
``MASTER_ADDR:MASTER_PORT`` as with ``env://``. Each rank runs ``python -u [-m] PROGRAM ARGS``
in a session of its own (as torchrun starts it), its output on the launcher's. When a rank
exits non-zero the others are ended (SIGTERM, then SIGKILL after a grace) and the launch
returns that rank's status (a signal's: 1, as :mod:`zeal.dist.quiet_torchrun` returns it).
What happened is written to ``LOGS/launcher.log`` (:data:`LOG_NAME`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

LOG_NAME = "launcher.log"
"""The launcher's own log in the launch's log folder (torchrun's is ``torchrun.log``)."""
POLL_S = 0.05  # how often the launcher looks at its ranks
GRACE_S = 5.0  # SIGTERM to SIGKILL


@dataclass(frozen=True)
class LocalLaunch:
    """The ranks of a single-node launch: ``nproc`` processes running ``command`` and
    meeting at ``master_addr:master_port`` (``None``: a free port)."""

    nproc: int
    command: list[str]
    master_addr: str = "127.0.0.1"
    master_port: int | None = None


def local_launch(argv: list[str]) -> LocalLaunch | None:
    """The :class:`LocalLaunch` a :func:`zeal.dist.launch.torchrun_argv` command line
    describes, or None when it needs torchrun (several nodes, a c10d rendezvous, restarts)."""
    if len(argv) < 4 or argv[1] != "-m":
        return None
    opts: dict[str, str] = {}
    i = 3
    while i < len(argv) and argv[i].startswith("--"):
        key, _, value = argv[i][2:].partition("=")
        opts[key] = value
        i += 1
    program = argv[i:]
    if not program or program == ["-m"] or int(opts.get("max-restarts") or 0) or "nproc-per-node" not in opts:
        return None
    if set(opts) - {"nproc-per-node", "standalone", "nnodes", "node-rank", "master-addr", "master-port",
                    "max-restarts"}:
        return None  # a rendezvous backend or anything else torchrun_argv adds for several nodes
    command = [argv[0], "-u", *program]  # "-m MODULE ARGS" or "SCRIPT ARGS", as torchrun runs them
    nproc = int(opts["nproc-per-node"])
    if "standalone" in opts:
        return LocalLaunch(nproc, command)
    if opts.get("nnodes") == "1" and opts.get("node-rank") == "0" and opts.get("master-addr"):
        return LocalLaunch(nproc, command, opts["master-addr"], int(opts.get("master-port") or 29500))
    return None


def local_rank_env(rank: int, nproc: int, addr: str, port: int, run_id: str) -> dict[str, str]:
    """torchrun's variables for local rank ``rank`` of a one-node job of ``nproc`` ranks."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default", "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": addr, "MASTER_PORT": str(port),
            "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")}


def run_local(launch: LocalLaunch, env: dict[str, str], logs: Path, port: int,
              timeout_s: float | None = None) -> int | None:
    """Start ``launch``'s ranks with ``env`` plus their variables (meeting at ``port``), wait
    for them; returns the exit status, or None when ``timeout_s`` ran out. Every rank has
    been ended when this returns."""
    run_id = str(uuid.uuid4())
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    procs: list[subprocess.Popen] = []
    with open(logs / LOG_NAME, "a") as log, _sigterm_raises():
        log.write(f"{_now()} {launch.nproc} ranks at {launch.master_addr}:{port}: {' '.join(launch.command)}\n")
        try:
            for rank in range(launch.nproc):
                rank_env = {**env, **local_rank_env(rank, launch.nproc, launch.master_addr, port, run_id)}
                procs.append(subprocess.Popen(launch.command, env=rank_env, start_new_session=True))
                log.write(f"{_now()} rank {rank}: pid {procs[-1].pid}\n")
            log.flush()
            while True:
                codes = [p.poll() for p in procs]
                failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    rank, code = failed[0], codes[failed[0]]
                    log.write(f"{_now()} rank {rank} failed first ({_status_text(code)}); ending the others\n")
                    return code if code > 0 else 1
                if all(c == 0 for c in codes):
                    log.write(f"{_now()} every rank exited with status 0\n")
                    return 0
                if deadline is not None and time.monotonic() >= deadline:
                    log.write(f"{_now()} the time limit ({timeout_s:g} s) ran out; ending the ranks\n")
                    return None
                time.sleep(POLL_S)
        except BaseException as e:  # Ctrl-C, SIGTERM, a failed start: the ranks go with us
            log.write(f"{_now()} the launcher stopped ({type(e).__name__}); ending the ranks\n")
            raise
        finally:
            end_ranks(procs)


def end_ranks(procs: list[subprocess.Popen], grace_s: float = GRACE_S) -> None:
    """SIGTERM each rank's session (the rank and whatever it started), SIGKILL those left
    after ``grace_s``; returns when every rank has exited."""
    _signal_groups(procs, signal.SIGTERM)
    end = time.monotonic() + grace_s
    while any(p.poll() is None for p in procs) and time.monotonic() < end:
        time.sleep(POLL_S)
    _signal_groups(procs, signal.SIGKILL)
    for p in procs:
        p.wait()


def _signal_groups(procs: list[subprocess.Popen], sig: signal.Signals) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, sig)  # the rank leads its session's group, even after it exited
        except (ProcessLookupError, PermissionError):
            if p.poll() is None:
                p.send_signal(sig)


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM to the launcher (``timeout``, a test harness, a job scheduler) raises
    SystemExit(143) so that the ranks are ended, as torchrun ends them (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old if old is not None else signal.SIG_DFL)


def _status_text(code: int) -> str:
    if code < 0:
        try:
            return f"ended by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"ended by signal {-code}"
    return f"exit status {code}"


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")
