"""DeepSpeed's top-level API on zeal, for scripts that change one import line.

``import zeal.deepspeed as deepspeed`` and a DeepSpeed training script runs as written::

    model_engine, optimizer, loader, lr_scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), config=ds_config)
    loss = model_engine(x); model_engine.backward(loss); model_engine.step()

What is here: :func:`initialize` (DeepSpeed's signature and 4-tuple), :func:`init_distributed`,
``zero.Init`` / ``zero.GatheredParameters`` (:mod:`zeal.deepspeed.zero`),
``checkpointing.checkpoint`` (:mod:`zeal.deepspeed.checkpointing`), ``moe.layer.MoE``
(:mod:`zeal.moe`), ``runtime.data_pipeline.data_routing.helper`` (random-LTD) and the engine's
DeepSpeed-shaped methods (:class:`DeepSpeedEngine`). ``zeal.initialize`` stays the native
entry point (it returns the engine alone).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

from zeal.deepspeed import checkpointing, moe, zero
from zeal.deepspeed.engine import DeepSpeedEngine

__all__ = ["DeepSpeedEngine", "checkpointing", "init_distributed", "initialize", "moe", "zero"]
__version__ = "0.19.0+zeal"


def initialize(args: Any = None, model: Any = None, optimizer: Any = None, model_parameters: Iterable[Any] | None = None,
               training_data: Any = None, lr_scheduler: Any = None, distributed_port: int = 29500, mpu: Any = None,
               dist_init_required: bool | None = None, collate_fn: Callable | None = None, config: Any = None,
               mesh_param: Any = None, config_params: Any = None) -> tuple[DeepSpeedEngine, Any, Any, Any]:
    """DeepSpeed's ``initialize``: ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    ``config`` is a dict or a JSON path (``args.deepspeed_config`` when not given, as in
    DeepSpeed); ``"auto"`` values are taken from the model and the client optimizer or
    name their key in a ConfigError. ``mpu`` and ``mesh_param`` (Megatron's model-parallel
    objects) are refused: zeal's tensor and pipeline parallelism come from the config
    (``tensor_parallel.autotp_size``, ``pipeline_parallel``)."""
    import zeal

    if mpu is not None or mesh_param is not None:
        raise ValueError("deepspeed.initialize: mpu / mesh_param are not supported by zeal; set "
                         "tensor_parallel.autotp_size / pipeline_parallel in the config instead")
    if model is None:
        raise ValueError("deepspeed.initialize: model is required")
    if config is None and config_params is None:
        config = getattr(args, "deepspeed_config", None)
    os.environ.setdefault("MASTER_PORT", str(distributed_port))
    engine = zeal.initialize(model, config if config is not None else config_params, optimizer=optimizer,
                             lr_scheduler=lr_scheduler, training_data=training_data,
                             model_parameters=model_parameters, collate_fn=collate_fn,
                             dist_init_required=dist_init_required)
    ds = DeepSpeedEngine(engine)
    return ds, engine.optimizer, engine.dataloader, engine.lr_scheduler


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: Any = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Join torchrun's job (DeepSpeed's ``init_distributed``). ``nccl`` without CUDA
    becomes ``gloo``; alone (no torchrun environment) it does nothing. The other
    arguments are accepted for compatibility."""
    import torch

    from zeal.dist.context import init_distributed as _join

    del auto_mpi_discovery, verbose, timeout, init_method, dist_init_required, config, rank, world_size
    os.environ.setdefault("MASTER_PORT", str(distributed_port))
    backend = dist_backend
    if backend in ("nccl", "ccl", "hccl") and not torch.cuda.is_available():
        backend = "gloo"
    _join(backend if backend in ("gloo", "nccl") else None, None)
