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


def main(argv: list[str] | None = None) -> int:
    """Turn the switch on and run the program named by ``argv``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv == ["-m"] or argv[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr if not argv else sys.stdout)
        return 2 if not argv else 0
    install()
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
