"""``deepspeed.runtime.utils``: ``set_random_seed``, ``see_memory_usage`` and ``move_to_device``."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch


def set_random_seed(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator (``seed mod 2**32``) and torch
    (every device), as DeepSpeed does."""
    random.seed(seed)
    try:
        import numpy
    except ImportError:  # NumPy is optional for zeal; without it there is nothing to seed
        numpy = None
    if numpy is not None:
        numpy.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log the accelerator's allocated / peak memory and the host's, on rank 0
    (only with ``force=True``, as in DeepSpeed)."""
    if not force:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    from zeal.deepspeed.accelerator import get_accelerator
    from zeal.deepspeed.utils.logging import logger

    acc = get_accelerator()
    gb = 2**30
    logger.info(f"{message} | MA {acc.memory_allocated() / gb:.2f} GB | Max_MA {acc.max_memory_allocated() / gb:.2f} GB"
                f" | total {acc.total_memory() / gb:.2f} GB | available {acc.available_memory() / gb:.2f} GB")


def move_to_device(item: Any, device: Any, criterion_func: Callable[[Any], bool] | None = None) -> Any:
    """``item`` (a tensor, or lists / tuples / dicts of them, nested) on ``device``, as
    DeepSpeed's: a leaf ``criterion_func`` accepts is moved in place (its ``.data`` swapped,
    so references to it see the move) and returned; any other leaf is ``.to(device)``."""
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item.to(device)
