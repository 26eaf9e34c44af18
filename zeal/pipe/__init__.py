"""Pipeline parallelism: ``PipelineModule`` / ``LayerSpec`` for users' own models, the
schedules, and the stage engine (``engine.train_batch``) ``zeal.initialize`` builds when
``pipeline_parallel.size > 1``."""

from zeal.pipe.module import LayerSpec, PipelineModule

__all__ = ["LayerSpec", "PipelineModule"]
