"""DeepSpeed's activation-checkpointing API (``deepspeed.checkpointing``) on torch's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.utils.checkpoint


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """Run ``function(*args)`` without keeping its activations; backward recomputes them."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """The same as :func:`checkpoint` (zeal's is always non-reentrant)."""
    return checkpoint(function, *args)


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    """Accepted for compatibility; refuses activation partitioning (needs tensor parallelism)."""
    if mpu_ is not None or partition_activations:
        raise ValueError("checkpointing.configure: partitioned activations need tensor parallelism, "
                         "which zeal does not have yet")


def is_configured() -> bool:
    """Always true: nothing needs configuring."""
    return True
