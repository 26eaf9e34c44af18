"""`zeal launch`: a thin layer over ``torch.distributed.run`` (torchrun).

One node: ``zeal launch --nproc 2 script.py args`` starts the ranks as torchrun ``--standalone``
would (same variables), from this process: no torchrun agent process.
Several nodes: run the same command on every node with ``--nnodes``,
``--node-rank`` and ``--master-addr``/``--master-port`` (c10d rendezvous hosted at
the master address), or give ``--hostfile`` (lines ``host [slots=N]``; the first
host is the master, this node's rank is its line unless ``--node-rank`` says
otherwise). zeal starts no remote processes itself: no ssh, no home-made protocol.
"""

from __future__ import annotations

import argparse
import socket
from dataclasses import dataclass
from pathlib import Path

# the launcher itself lives in zeal.dist.launch (one way to start ranks); its command-line
# builders are re-exported here for the commands and scripts that import them from this module
from zeal.dist.launch import RANK_MAIN, RUNNER, child_env, run_torchrun, torchrun_argv  # noqa: F401


@dataclass(frozen=True)
class Host:
    """One hostfile line."""

    name: str
    slots: int | None = None


def parse_hostfile(text: str, source: str = "hostfile") -> list[Host]:
    """Hosts from ``host [slots=N]`` lines; ``#`` starts a comment."""
    hosts: list[Host] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, *rest = line.split()
        slots = None
        for item in rest:
            key, _, value = item.partition("=")
            if key != "slots" or not value.isdigit() or int(value) < 1:
                raise ValueError(f"{source}:{lineno}: expected 'host slots=N', got {raw.strip()!r}")
            slots = int(value)
        if any(h.name == name for h in hosts):
            raise ValueError(f"{source}:{lineno}: host {name!r} listed twice")
        hosts.append(Host(name, slots))
    if not hosts:
        raise ValueError(f"{source}: no hosts")
    return hosts


def _this_node_rank(hosts: list[Host]) -> int:
    names = {socket.gethostname(), socket.getfqdn(), "localhost", "127.0.0.1"}
    for i, h in enumerate(hosts):
        if h.name in names:
            return i
    raise ValueError("--hostfile: this machine is not in it; pass --node-rank")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``zeal launch``."""
    p = subparsers.add_parser(
        "launch", help="run a script on N processes (and N nodes), as torchrun does",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--nproc", type=int, default=None, help="processes per node (default: hostfile slots or 1)")
    p.add_argument("--nnodes", type=int, default=None, help="number of nodes (default 1, or the hostfile's)")
    p.add_argument("--node-rank", type=int, default=None, help="this node's rank among the nodes")
    p.add_argument("--master-addr", default=None, help="address of node 0, hosting the c10d rendezvous")
    p.add_argument("--master-port", type=int, default=29500, help="rendezvous port (default 29500)")
    p.add_argument("--hostfile", default=None, help="file of 'host slots=N' lines; first host is the master")
    p.add_argument("--rdzv-id", default="zeal", help="job id shared by all nodes of one run")
    p.add_argument("--rdzv-backend", default="c10d", choices=["c10d", "static"],
                   help="c10d (default; ranks by arrival) or static (ranks by --node-rank)")
    p.add_argument("-m", "--module", action="store_true", help="the program is a Python module, as python -m")
    p.add_argument("--log-dir", default=None,
                   help="where a failing rank writes its traceback (rankN.log) and the launcher its own log "
                        "(default: a temporary folder, removed after a successful run)")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="end the ranks after S seconds, with each rank's last collectives reported")
    p.add_argument("--dry-run", action="store_true", help="print the torchrun command and exit")
    p.add_argument("program", nargs=argparse.REMAINDER, help="script.py (or module with -m) and its arguments")


def run(args: argparse.Namespace) -> int:
    """Run ``zeal launch``: build the torchrun command, run it (one node: without torchrun),
    return its exit code."""
    nproc, nnodes, node_rank, master = args.nproc, args.nnodes, args.node_rank, args.master_addr
    if args.hostfile:
        path = Path(args.hostfile)
        if not path.is_file():
            raise ValueError(f"--hostfile {args.hostfile!r} is not a file")
        hosts = parse_hostfile(path.read_text(), args.hostfile)
        nnodes = nnodes or len(hosts)
        master = master or hosts[0].name
        if node_rank is None:
            node_rank = _this_node_rank(hosts)
        if nproc is None:
            nproc = hosts[node_rank].slots
    if not args.program:
        raise ValueError("nothing to launch: give a script (or -m module) and its arguments")
    # Each rank runs the program under zeal.dist.rank_main, which records its error for this
    # process to print once; the launcher's (or torchrun's) own report goes to a log file.
    program = [RANK_MAIN, *(["-m"] if args.module else []), *args.program]
    argv = torchrun_argv(nproc or 1, program, nnodes=nnodes or 1, node_rank=node_rank, master_addr=master,
                         master_port=args.master_port, rdzv_id=args.rdzv_id, rdzv_backend=args.rdzv_backend,
                         module=True, runner=RUNNER)
    if args.dry_run:
        print(" ".join(argv))
        return 0
    return _run_ranks(argv, nproc or 1, args.log_dir, args.timeout)


def _run_ranks(argv: list[str], nproc: int, log_dir: str | None, timeout_s: float | None = None) -> int:
    """Run the command (:func:`zeal.dist.launch.run_torchrun`; one node: no torchrun): on failure the
    forensics report, if any, and the first rank's error in one line."""
    return run_torchrun(argv, nproc, prog="zeal launch", log_dir=log_dir, timeout_s=timeout_s)
