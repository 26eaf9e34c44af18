"""``deepspeed.initialize(mpu=...)``: a model-parallel unit (Megatron's ``mpu`` interface)
is accepted when it describes the layout zeal builds from the config itself.

DeepSpeed's AutoTP examples pass both ``tensor_parallel.autotp_size`` and an ``mpu`` whose
tensor-parallel groups are consecutive ranks and data-parallel groups stride ``tp`` —
zeal's mesh layout (:mod:`zeal.dist.mesh`). Such an ``mpu`` only restates the config, so
it is checked and not used. An ``mpu`` with tensor parallelism the config does not ask for
is a model split by hand (Megatron): refused, as before, in one line."""

from __future__ import annotations

from typing import Any


def _size(mpu: Any, *names: str, default: int = 1) -> int:
    for name in names:
        fn = getattr(mpu, name, None)
        if callable(fn):
            return int(fn())
    return default


def check_mpu(mpu: Any, config: dict | None) -> None:
    """Raise ValueError unless ``mpu`` agrees with ``config`` and zeal's rank layout."""
    import torch.distributed as dist

    from zeal.deepspeed.runtime.sequence_parallel import parallel_state_sp

    if mpu is parallel_state_sp:  # ALST's sp mpu (register_with_transformers): zeal's own sp layout
        return
    tp = _size(mpu, "get_tensor_model_parallel_world_size", "get_model_parallel_world_size")
    pp = _size(mpu, "get_pipeline_model_parallel_world_size")
    dp = _size(mpu, "get_data_parallel_world_size")
    cfg = config or {}
    want_tp = int((cfg.get("tensor_parallel") or {}).get("autotp_size", 1) or 1)
    want_pp = int((cfg.get("pipeline_parallel") or {}).get("size", 1) or 1)
    if (tp, pp) != (want_tp, want_pp):
        raise ValueError(f"deepspeed.initialize: the mpu has tensor-parallel size {tp} and pipeline size {pp}, the "
                         f"config {want_tp} (tensor_parallel.autotp_size) and {want_pp} (pipeline_parallel.size); "
                         "zeal splits the model itself from the config: set them there (a model split by hand, "
                         "Megatron style, is not supported)")
    if not (dist.is_available() and dist.is_initialized()):
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    if dp * tp * pp != world:
        raise ValueError(f"deepspeed.initialize: the mpu's data × tensor × pipeline sizes {dp} × {tp} × {pp} "
                         f"are not the world size {world}")
    got = (_size(mpu, "get_tensor_model_parallel_rank", "get_model_parallel_rank", default=0),
           _size(mpu, "get_data_parallel_rank", default=0))
    if got != (rank % tp, (rank // tp) % dp):
        raise ValueError(f"deepspeed.initialize: the mpu puts rank {rank} at tensor-parallel rank {got[0]}, "
                         f"data-parallel rank {got[1]}; zeal's layout has tensor-parallel ranks adjacent "
                         f"({rank % tp}, {(rank // tp) % dp}): build the groups that way or drop the mpu")
