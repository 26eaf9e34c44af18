"""``deepspeed.runtime.zero.config``: ``ZeroStageEnum``."""

from enum import IntEnum


class ZeroStageEnum(IntEnum):
    """ZeRO's stages by name (DeepSpeed's enum)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3
