"""``deepspeed.moe`` on zeal: ``layer.MoE`` and ``utils`` (see :mod:`zeal.moe`)."""

from zeal.deepspeed.moe import layer, utils

__all__ = ["layer", "utils"]
