"""``deepspeed.runtime.utils``: ``set_random_seed`` and ``see_memory_usage``."""

from __future__ import annotations

import random

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
