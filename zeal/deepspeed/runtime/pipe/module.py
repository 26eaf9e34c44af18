"""``deepspeed.runtime.pipe.module`` (see :mod:`zeal.deepspeed.pipe`)."""

from zeal.deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
