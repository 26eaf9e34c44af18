"""``deepspeed.runtime.activation_checkpointing.checkpointing`` (= ``deepspeed.checkpointing``)."""

from zeal.deepspeed.checkpointing import checkpoint, configure, is_configured, non_reentrant_checkpoint

__all__ = ["checkpoint", "configure", "is_configured", "non_reentrant_checkpoint"]
