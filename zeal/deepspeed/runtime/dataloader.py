"""``deepspeed.runtime.dataloader``: ``RepeatingLoader``."""

from zeal.deepspeed.utils.misc import RepeatingLoader

__all__ = ["RepeatingLoader"]
