"""``python -m zeal.deepspeed SCRIPT [ARGS]`` (or ``-m MODULE [ARGS]``): run a DeepSpeed
script unchanged on zeal, in a process started by any launcher (torchrun, ``accelerate
launch``, SLURM's ``srun``): the switch (:mod:`zeal.deepspeed.switch`) is turned on, then
the script runs as ``python SCRIPT ARGS`` would run it (``__name__ == "__main__"``,
``sys.argv``, ``sys.path[0]``). Started by ``zeal deepspeed``, the script also gets
``--local_rank=N`` before its own arguments, as DeepSpeed's launcher passes it.

Example: ``torchrun --nproc-per-node 2 -m zeal.deepspeed train.py --deepspeed_config ds.json``.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from zeal.deepspeed.switch import install

PASS_LOCAL_RANK = "ZEAL_DS_PASS_LOCAL_RANK"  # set by `zeal deepspeed` (unless --no_local_rank)
BIND_CORES = "ZEAL_DS_BIND_CORES"  # `zeal deepspeed --bind_cores_to_rank [--bind_core_list L]`
RANK_LOG_DIR = "ZEAL_DS_RANK_LOG_DIR"  # `zeal deepspeed --enable_each_rank_log DIR`


def cores_of_rank(core_list: str, nproc: int, local_rank: int) -> list[int]:
    """Rank ``local_rank``'s cores as DeepSpeed's launcher shares them: ``core_list``
    ("0,2-5") cut into ``nproc`` equal consecutive pieces, the remainder unused."""
    cores: list[int] = []
    try:
        for part in core_list.split(","):
            lo, _, hi = part.partition("-")
            cores.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"--bind_core_list {core_list!r}: expected numbers and ranges, e.g. 0,2-5") from None
    per_rank = len(cores) // nproc
    if per_rank < 1:
        raise ValueError(f"--bind_cores_to_rank: {len(cores)} cores for {nproc} ranks; each rank needs one")
    return cores[per_rank * local_rank:per_rank * (local_rank + 1)]


def apply_rank_env() -> None:
    """In a rank started by ``zeal deepspeed``: bind it to its cores and send its output
    to its own log file, as the launcher's flags asked."""
    local_rank, nproc = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if os.environ.get(BIND_CORES):
        cores = cores_of_rank(os.environ[BIND_CORES], nproc, local_rank)
        os.sched_setaffinity(0, cores)
        os.environ["OMP_NUM_THREADS"] = str(len(cores))
        import torch

        torch.set_num_threads(len(cores))
    if os.environ.get(RANK_LOG_DIR):
        log = open(Path(os.environ[RANK_LOG_DIR]) / f"rank{os.environ.get('RANK', '0')}.log", "a")  # noqa: SIM115
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)


def main(argv: list[str] | None = None) -> int:
    """Turn the switch on and run the program named by ``argv``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv == ["-m"] or argv[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr if not argv else sys.stdout)
        return 2 if not argv else 0
    install()
    apply_rank_env()
    module = argv[0] == "-m"
    program, args = (argv[1], argv[2:]) if module else (argv[0], argv[1:])
    if os.environ.get(PASS_LOCAL_RANK) == "1":
        args = [f"--local_rank={os.environ.get('LOCAL_RANK', '0')}", *args]
    sys.argv = [program, *args]
    if module:
        runpy.run_module(program, run_name="__main__", alter_sys=True)
    else:
        if not Path(program).is_file():
            print(f"zeal.deepspeed: {program!r} is not a file", file=sys.stderr)
            return 2
        sys.path[0] = str(Path(program).resolve().parent)
        runpy.run_path(program, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
