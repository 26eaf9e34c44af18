"""Errors of launched ranks (every CLI command that starts ranks): each failing rank
records its own, the launcher (:mod:`zeal.dist.launch`) reports the first one.

A rank writes ``RUN/logs/rankN.log`` (the full traceback) and ``RUN/logs/rankN.json``
(time, one-line message, log path). After a failed launch, the launching
process reads the records and prints the earliest once, in one line, with the path
of its log; ranks that failed only because a peer died come later and are skipped.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path

USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, TimeoutError)
"""Errors reported without their type name, as ``zeal``'s main reports them (exit status 2)."""


def one_line(exc: BaseException) -> str:
    """The error as one line: its message, prefixed by its type unless it is a user error."""
    msg = " ".join(str(exc).split())
    if isinstance(exc, USER_ERRORS):
        return msg or type(exc).__name__
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def exit_status(exc: BaseException) -> int:
    """2 for bad input (as ``zeal``'s main), 1 for anything else."""
    return 2 if isinstance(exc, USER_ERRORS) else 1


def record_rank_error(log_dir: str | Path, rank: int, exc: BaseException) -> Path:
    """Write this rank's traceback and one-line record; returns the log's path."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"rank{rank}.log"
    now = time.time()
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    log.write_text(f"zeal: rank {rank} (pid {os.getpid()}) failed at "
                   f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(now))} UTC\n\n{text}")
    record = {"rank": rank, "time": now, "error": one_line(exc), "log": str(log)}
    tmp = log_dir / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, log_dir / f"rank{rank}.json")
    return log


def clear_rank_errors(log_dir: str | Path) -> None:
    """Remove the records of an earlier launch (before starting the ranks)."""
    log_dir = Path(log_dir)
    if log_dir.is_dir():
        for p in list(log_dir.glob("rank*.json")) + list(log_dir.glob("rank*.log")) + \
                list(log_dir.glob("collectives-rank*.json")):
            p.unlink(missing_ok=True)


def first_rank_error(log_dir: str | Path) -> dict | None:
    """The earliest record (ties: the lowest rank), or None when no rank recorded one."""
    records = []
    for p in Path(log_dir).glob("rank*.json"):
        try:
            records.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return min(records, key=lambda r: (r["time"], r["rank"])) if records else None


def failure_line(log_dir: str | Path, rc: int, prog: str, torchrun_log: str | Path | None = None) -> str:
    """The one line a launcher prints after its ranks failed with status ``rc``."""
    first = first_rank_error(log_dir)
    if first is None:
        where = f"; see {torchrun_log}" if torchrun_log else ""
        return f"{prog}: error: the ranks failed (exit status {rc}){where}"
    return f"{prog}: error: rank {first['rank']}: {first['error']} (full log: {first['log']})"
