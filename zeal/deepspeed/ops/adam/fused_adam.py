"""``deepspeed.ops.adam.fused_adam``: ``FusedAdam``."""

from zeal.deepspeed.ops.adam import FusedAdam

__all__ = ["FusedAdam"]
