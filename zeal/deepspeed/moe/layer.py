"""``deepspeed.moe.layer``: the MoE layer (:class:`zeal.moe.MoE`)."""

from zeal.moe.layer import MoE

__all__ = ["MoE"]
