"""``deepspeed.runtime.engine``: ``DeepSpeedEngine`` (see :mod:`zeal.deepspeed.engine`)."""

from zeal.deepspeed.engine import DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
