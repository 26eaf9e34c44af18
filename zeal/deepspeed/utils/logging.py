"""DeepSpeed's logger (``DeepSpeed``, INFO, to stdout) and ``log_dist``."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable

logger = logging.getLogger("DeepSpeed")
if not logger.handlers:
    _h = logging.StreamHandler(sys.stdout)
    _h.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] "
                                      "%(message)s"))
    logger.addHandler(_h)
    logger.setLevel(logging.INFO)
    logger.propagate = False

_seen: set[str] = set()


def _should_log(ranks: Iterable[int] | None) -> bool:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return True  # alone: always
    ranks = list(ranks or [])
    return bool(ranks) and (ranks[0] == -1 or dist.get_rank() in set(ranks))


def log_dist(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the ranks in ``ranks`` (``[-1]``: every rank). As in DeepSpeed,
    once torch.distributed is started, ``ranks=None`` logs nowhere; before, it logs."""
    if _should_log(ranks):
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else -1
        logger.log(level, f"[Rank {rank}] {message}")


def log_dist_once(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """:func:`log_dist`, the first time this message is given only."""
    if message not in _seen:
        _seen.add(message)
        log_dist(message, ranks, level)


def set_log_level_from_string(log_level_str: str, custom_logger: logging.Logger | None = None) -> None:
    """Set the logger's level by name (``debug``, ``info``, ``warning``, ``error``, ``critical``)."""
    level = getattr(logging, log_level_str.upper(), None)
    if not isinstance(level, int):
        raise ValueError(f"log level {log_level_str!r}: use debug, info, warning, error or critical")
    (custom_logger or logger).setLevel(level)
