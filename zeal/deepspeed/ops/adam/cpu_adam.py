"""``deepspeed.ops.adam.cpu_adam``: ``DeepSpeedCPUAdam``."""

from zeal.deepspeed.ops.adam import DeepSpeedCPUAdam

__all__ = ["DeepSpeedCPUAdam"]
