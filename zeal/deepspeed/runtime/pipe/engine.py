"""``deepspeed.runtime.pipe.engine``: ``PipelineEngine`` (see :mod:`zeal.deepspeed.engine`)."""

from zeal.deepspeed.engine import PipelineEngine

__all__ = ["PipelineEngine"]
