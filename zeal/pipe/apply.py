"""The pipeline apply-step: keep this rank's stage of the model (before ZeRO flattens it)."""

from __future__ import annotations

from torch import nn

from zeal.config import Config, ConfigError
from zeal.dist.mesh import Mesh
from zeal.pipe.stages import Stage, split_model


def apply_pipeline(model: nn.Module, cfg: Config, mesh: Mesh, accum: int) -> Stage | None:
    """Cut ``model`` to this rank's stage (``mesh.pp_rank`` of ``pipeline_parallel.size``),
    in place; None without pipeline parallelism. ``accum`` (the resolved
    gradient_accumulation_steps) is the number of micro-batches of one step."""
    pc = cfg.pipeline_parallel
    if pc.size == 1:
        return None
    if pc.micro_batches is not None and pc.micro_batches != accum:
        raise ConfigError(f"pipeline_parallel.micro_batches {pc.micro_batches} != gradient_accumulation_steps "
                          f"{accum}: one optimizer step runs the micro-batches of its accumulation")
    if pc.schedule == "interleaved" and pc.virtual_stages < 2:
        raise ConfigError("pipeline_parallel.schedule 'interleaved' needs pipeline_parallel.virtual_stages >= 2 "
                          "(model chunks per stage)")
    if pc.schedule != "interleaved" and pc.virtual_stages != 1:
        raise ConfigError(f"pipeline_parallel.virtual_stages {pc.virtual_stages} needs schedule 'interleaved' "
                          f"(got {pc.schedule!r})")
    if pc.schedule == "interleaved" and accum % pc.size:
        raise ConfigError(f"pipeline_parallel.micro_batches {accum} is not a multiple of pipeline_parallel.size "
                          f"{pc.size}, as the interleaved schedule needs")
    try:
        return split_model(model, mesh.pp_rank, pc.size, pc.virtual_stages)
    except ValueError as e:
        raise ConfigError(str(e)) from None
