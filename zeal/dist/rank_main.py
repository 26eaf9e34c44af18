"""One rank of ``zeal launch`` (and ``zeal deepspeed``): the user's script (or ``-m`` module) run as ``python``
would run it, its error recorded for the launcher instead of printed.

``python -m zeal.dist.rank_main script.py ARGS`` (or ``-m module ARGS``) runs the program
with ``__name__ == "__main__"``, ``sys.argv`` and ``sys.path[0]`` as ``python`` sets them.
An exception other than ``SystemExit`` is written to ``$ZEAL_RANK_LOG_DIR`` (traceback in
``rankN.log``, one-line record in ``rankN.json``, :mod:`zeal.dist.rank_errors`) and ends
the rank with status 1 (2 for bad input); ``zeal launch`` prints the first of them once.
Without ``$ZEAL_RANK_LOG_DIR`` the exception propagates as usual.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from zeal.dist.rank_errors import exit_status, record_rank_error


def main(argv: list[str] | None = None) -> int:
    """Run the program named by ``argv``; 0, or the recorded error's exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv == ["-m"]:
        print("zeal.dist.rank_main: nothing to run (give script.py or -m module)", file=sys.stderr)
        return 2
    log_dir = os.environ.get("ZEAL_RANK_LOG_DIR")
    from zeal.dist.launch import watch_deadline

    watch_deadline()
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            sys.path[0] = str(Path(argv[0]).resolve().parent)
            runpy.run_path(argv[0], run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:  # noqa: BLE001 - any failure of the user's program is this rank's to record
        if not log_dir:
            raise
        record_rank_error(log_dir, int(os.environ.get("RANK", "0")), e)
        return exit_status(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
