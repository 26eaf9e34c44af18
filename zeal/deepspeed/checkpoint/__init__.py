"""``deepspeed.checkpoint``: ``utils.clone_tensors_for_torch_save`` (what accelerate and
Hugging Face import). DeepSpeed's checkpoint readers and converters (``DeepSpeedCheckpoint``,
universal checkpoints) are refused: zeal's checkpoints load at any world size and stage."""

from __future__ import annotations

from typing import Any

from zeal.deepspeed.checkpoint import utils
from zeal.deepspeed.refusals import refuse

__all__ = ["utils"]


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return refuse(f"deepspeed.checkpoint.{name}", "zeal's checkpoints: engine.save_checkpoint / load_checkpoint "
                  "(any world size and stage), zeal.checkpoint, `zeal checkpoint export`")
