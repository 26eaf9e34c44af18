"""torchrun for the ranks :mod:`zeal.dist.launch` starts, without torchrun's own report of a failure.

``python -m zeal.dist.quiet_torchrun ARGS`` is ``python -m torch.distributed.run ARGS``
except that torchrun's log lines go to the file named by ``$ZEAL_TORCHRUN_LOG``
(not the console) and a failed rank ends the launch with that rank's exit status
and no traceback: the ranks record their own errors (:mod:`zeal.dist.rank_errors`)
and the launching process (:func:`zeal.dist.launch.launch_ranks`) prints the first of them.
"""

from __future__ import annotations

import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv``; its exit status (the first failed rank's on failure)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    log = logging.getLogger("torch.distributed")
    path = os.environ.get("ZEAL_TORCHRUN_LOG")
    if path:
        _to_file(log, path)
    try:
        torchrun.main(list(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        log.error("rank %s failed first (exit status %s)\n%s", rank, failure.exitcode, e.format_msg())
        return failure.exitcode if isinstance(failure.exitcode, int) and failure.exitcode > 0 else 1
    return 0


def _to_file(log: logging.Logger, path: str) -> None:
    """Send ``log`` and every logger below it to ``path`` only (torch puts console
    handlers on its loggers when it is imported)."""
    prefix = log.name + "."
    for name, child in list(logging.root.manager.loggerDict.items()):
        if name.startswith(prefix) and isinstance(child, logging.Logger):
            for h in list(child.handlers):
                child.removeHandler(h)
            child.propagate = True
    for h in list(log.handlers):
        log.removeHandler(h)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log.addHandler(handler)
    log.propagate = False


if __name__ == "__main__":
    sys.exit(main())
