"""``deepspeed.pipe``'s names for one-import-line scripts: ``PipelineModule``, ``LayerSpec``
(see :mod:`zeal.pipe`); the engine's ``train_batch`` / ``eval_batch`` come with
``pipeline_parallel.size > 1`` in the config."""

from zeal.pipe.module import LayerSpec, PipelineModule

__all__ = ["LayerSpec", "PipelineModule"]
