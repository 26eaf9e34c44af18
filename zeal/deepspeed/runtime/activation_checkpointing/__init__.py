"""``deepspeed.runtime.activation_checkpointing`` (see :mod:`zeal.deepspeed.checkpointing`)."""

from zeal.deepspeed import checkpointing

__all__ = ["checkpointing"]
