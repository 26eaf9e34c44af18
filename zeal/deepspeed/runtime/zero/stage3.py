"""``deepspeed.runtime.zero.stage3``: ``unwrap_model_for_generation``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def unwrap_model_for_generation(model: Any) -> Iterator[Any]:
    """The model with its full parameters inside the block (a ZeRO-3 engine gathers them
    and releases them after); ``model`` may be a DeepSpeed engine or a plain module."""
    engine = getattr(model, "engine", None)
    module = getattr(model, "module", model)
    if engine is not None and hasattr(engine, "gathered_parameters"):
        with engine.gathered_parameters():
            yield module
    else:
        yield module
