"""``deepspeed.runtime.pipe.engine``: ``PipelineEngine`` (zeal's stage engine behind the
DeepSpeed facade; ``deepspeed.initialize`` returns it for a ``PipelineModule``)."""

from zeal.deepspeed.engine import DeepSpeedEngine as PipelineEngine

__all__ = ["PipelineEngine"]
