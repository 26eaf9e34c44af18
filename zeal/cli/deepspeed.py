"""`zeal deepspeed`: DeepSpeed's ``deepspeed`` launcher, on zeal, for unchanged scripts.

``zeal deepspeed [--num_gpus N] [--num_nodes N] [--hostfile F] [--include/--exclude SPEC]
[--master_port P] [--master_addr A] SCRIPT [ARGS]`` starts the ranks (this process
starts one node's ranks itself, as DeepSpeed's launcher does; torchrun for several nodes:
:mod:`zeal.dist.launch`); in each, ``import deepspeed`` and every ``deepspeed.*`` module
resolve to ``zeal.deepspeed`` (:mod:`zeal.deepspeed.switch`), and the script gets
``--local_rank=N`` before its own arguments (not with ``--no_local_rank``) and the
environment DeepSpeed's launcher sets: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, LOCAL_SIZE, CROSS_RANK, CROSS_SIZE.

Resources are DeepSpeed's: a hostfile of ``host slots=N`` lines (default: this machine
with its GPUs, or one process on a CPU-only machine; there ``--num_gpus N`` means N
processes); ``--include``/``--exclude`` as ``host[:slot,slot][@host...]``; ``--num_nodes``
keeps the first hosts; ``--num_gpus`` the first slots of each. zeal starts no remote
processes (no ssh, no pdsh): with several hosts, run the same command on each of them.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections import OrderedDict
from pathlib import Path

from zeal.cli.launch import _run_ranks, parse_hostfile, torchrun_argv


def parse_spec(text: str, flag: str) -> OrderedDict[str, list[int]]:
    """``host[:slot,slot][@host...]`` → {host: slots} (an empty list: every slot)."""
    out: OrderedDict[str, list[int]] = OrderedDict()
    for node in text.split("@"):
        name, _, slots = node.partition(":")
        if not name:
            raise ValueError(f"--{flag} {text!r}: expected host[:slot,slot][@host...]")
        try:
            out[name] = [int(s) for s in slots.split(",")] if slots else []
        except ValueError:
            raise ValueError(f"--{flag} {text!r}: slots must be integers") from None
    return out


def select_resources(pool: OrderedDict[str, list[int]], include: str = "", exclude: str = "",
                     num_nodes: int = -1, num_gpus: int = -1) -> OrderedDict[str, list[int]]:
    """The hosts and slots a run uses, as DeepSpeed's launcher picks them: ``include`` or
    ``exclude`` filters the pool, then ``num_nodes`` keeps the first hosts and
    ``num_gpus`` the first slots of each host."""
    if include and exclude:
        raise ValueError("--include and --exclude are mutually exclusive")
    chosen = OrderedDict((h, list(s)) for h, s in pool.items())
    if include or exclude:
        spec = parse_spec(include or exclude, "include" if include else "exclude")
        for host, slots in spec.items():
            if host not in pool:
                raise ValueError(f"--{'include' if include else 'exclude'}: host {host!r} is not in the resource pool "
                                 f"({', '.join(pool)})")
            bad = [s for s in slots if s not in pool[host]]
            if bad:
                raise ValueError(f"host {host!r} has no slot {bad[0]} (slots: {pool[host]})")
        if include:
            chosen = OrderedDict((h, spec[h] or list(pool[h])) for h in pool if h in spec)
        else:
            for host, slots in spec.items():
                chosen[host] = [s for s in chosen[host] if s not in slots] if slots else []
    chosen = OrderedDict((h, list(dict.fromkeys(s))) for h, s in chosen.items() if s)
    if num_nodes > 0:
        chosen = OrderedDict(list(chosen.items())[:num_nodes])
    if num_gpus > 0:
        chosen = OrderedDict((h, s[:num_gpus]) for h, s in chosen.items())
    if not chosen:
        raise ValueError("no resources left to run on (check --include/--exclude/--num_nodes/--num_gpus)")
    return chosen


def local_pool(num_gpus: int) -> OrderedDict[str, list[int]]:
    """This machine alone: its GPUs, or (CPU only) ``num_gpus`` processes, default 1."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else max(num_gpus, 1)
    return OrderedDict(localhost=list(range(n)))


def _this_host(hosts: list[str]) -> int | None:
    names = {socket.gethostname(), socket.getfqdn(), "localhost", "127.0.0.1"}
    return next((i for i, h in enumerate(hosts) if h in names), None)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``zeal deepspeed`` (DeepSpeed's launcher flags, underscores and all)."""
    p = subparsers.add_parser(
        "deepspeed", help="run an unchanged DeepSpeed script on zeal (DeepSpeed's launcher flags)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("-H", "--hostfile", default=None, help="'host slots=N' lines (default: this machine)")
    p.add_argument("-i", "--include", default="", help="resources to use: host[:slot,slot][@host...]")
    p.add_argument("-e", "--exclude", default="", help="resources not to use (same format as --include)")
    p.add_argument("--num_nodes", type=int, default=-1, help="use the first N hosts")
    p.add_argument("--num_gpus", "--num_accelerators", type=int, default=-1,
                   help="GPUs (CPU-only machine: processes) per node")
    p.add_argument("--master_port", type=int, default=29500, help="rendezvous port (default 29500)")
    p.add_argument("--master_addr", default=None, help="address of the first node (default: the first host)")
    p.add_argument("--node_rank", type=int, default=None, help="this node's rank (default: its hostfile line)")
    p.add_argument("--module", action="store_true", help="SCRIPT is a Python module, as python -m")
    p.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank to the script")
    p.add_argument("--no_python", action="store_true", help="refused: zeal runs Python scripts only")
    p.add_argument("--launcher", default="pdsh", help="accepted; zeal starts no remote processes (torchrun on each node)")
    p.add_argument("--log_dir", default=None, help="where a failing rank writes its traceback (rankN.log)")
    p.add_argument("--dry_run", action="store_true", help="print the torchrun command and exit")
    _add_accepted_flags(p)
    p.add_argument("user_script", help="the DeepSpeed training script (or module with --module)")
    p.add_argument("user_args", nargs=argparse.REMAINDER, help="its arguments")
    return p


def _add_accepted_flags(p: argparse.ArgumentParser) -> None:
    """The rest of DeepSpeed's launcher flags, so that a run script's command line parses:
    core binding and per-rank logs act; the remote-launch ones have nothing to do here."""
    p.add_argument("--bind_cores_to_rank", action="store_true",
                   help="give each rank its own share of the cores (affinity + OMP_NUM_THREADS)")
    p.add_argument("--bind_core_list", default=None, help="cores to share out, e.g. 0,2-5 (default: all)")
    p.add_argument("--enable_each_rank_log", default="None", help="folder for one stdout/stderr log per rank")
    p.add_argument("--save_pid", action="store_true", help="write this launcher's pid to /tmp/<pid>.ds")
    p.add_argument("--autotuning", default="", choices=["tune", "run"], help="refused: no autotuner in zeal")
    p.add_argument("--log_level", default="info", choices=["debug", "info", "warning", "error", "critical"],
                   help="accepted (the launcher's own log level)")
    p.add_argument("-q", "--quiet", action="store_true", help="accepted (--log_level error)")
    for flag in ("--no_ssh", "--no_ssh_check", "--force_multi"):
        p.add_argument(flag, action="store_true", help="accepted; zeal starts no remote processes")
    for flag in ("--launcher_args", "--ssh_port", "--venv_script"):
        p.add_argument(flag, default=None, help="accepted; zeal starts no remote processes")


def _rank_env(args: argparse.Namespace, nproc: int) -> dict[str, str]:
    """Environment for the ranks from the core-binding and per-rank-log flags (read by
    :func:`zeal.deepspeed.__main__.apply_rank_env` in each rank)."""
    from zeal.deepspeed.__main__ import BIND_CORES, RANK_LOG_DIR, cores_of_rank

    env: dict[str, str] = {}
    if args.bind_cores_to_rank:
        cores = args.bind_core_list or ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
        per_rank = cores_of_rank(cores, nproc, 0)  # checks the list and that every rank gets a core
        env[BIND_CORES] = cores
        env["OMP_NUM_THREADS"] = str(len(per_rank))
    if args.enable_each_rank_log != "None":
        Path(args.enable_each_rank_log).mkdir(parents=True, exist_ok=True)
        env[RANK_LOG_DIR] = str(Path(args.enable_each_rank_log).resolve())
    return env


def run(args: argparse.Namespace) -> int:
    """Pick the resources, then start this node's ranks (:func:`zeal.dist.launch.run_torchrun`)."""
    from zeal.deepspeed.__main__ import PASS_LOCAL_RANK
    from zeal.deepspeed.switch import ENV, site_dir

    if args.no_python:
        raise ValueError("--no_python: zeal deepspeed runs Python scripts (zeal's DeepSpeed lives in Python)")
    if args.autotuning:
        raise ValueError(f"--autotuning {args.autotuning}: zeal has no autotuner; size the job with "
                         "`zeal estimate --budget` and pass the config as it is")
    if args.save_pid:
        Path(f"/tmp/{os.getpid()}.ds").write_text(str(os.getpid()))
    if args.hostfile:
        path = Path(args.hostfile)
        if not path.is_file():
            raise ValueError(f"--hostfile {args.hostfile!r} is not a file")
        pool = OrderedDict((h.name, list(range(h.slots or 1))) for h in parse_hostfile(path.read_text(), args.hostfile))
    else:
        pool = local_pool(args.num_gpus)
    res = select_resources(pool, args.include, args.exclude, args.num_nodes, args.num_gpus)
    hosts = list(res)
    node_rank = args.node_rank if args.node_rank is not None else (0 if len(hosts) == 1 else _this_host(hosts))
    if node_rank is None or not 0 <= node_rank < len(hosts):
        raise ValueError("this machine is not among the selected hosts; pass --node_rank")
    slots = res[hosts[node_rank]]
    master = args.master_addr or ("127.0.0.1" if len(hosts) == 1 else hosts[0])
    program = ["zeal.cli.rank_main", "-m", "zeal.deepspeed", *(["-m"] if args.module else []),
               args.user_script, *args.user_args]
    argv = torchrun_argv(len(slots), program, nnodes=len(hosts), node_rank=node_rank, master_addr=master,
                         master_port=args.master_port, rdzv_backend="static", module=True,
                         runner="zeal.cli.quiet_torchrun")
    if args.dry_run:
        print(" ".join(argv))
        return 0
    env = {ENV: "1", "LOCAL_SIZE": str(len(slots)), "CROSS_RANK": str(node_rank), "CROSS_SIZE": str(len(hosts)),
           **_rank_env(args, len(slots))}
    if not args.no_local_rank:
        env[PASS_LOCAL_RANK] = "1"
    if _has_cuda():  # DeepSpeed's launcher shows each node only its selected devices
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(s) for s in slots)
    old = {k: os.environ.get(k) for k in [*env, "PYTHONPATH"]}
    os.environ.update(env)
    # child processes of the script (data-loader workers, subprocesses) get the switch too
    os.environ["PYTHONPATH"] = site_dir() + (os.pathsep + old["PYTHONPATH"] if old["PYTHONPATH"] else "")
    try:
        return _run_ranks(argv, len(slots), args.log_dir)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
