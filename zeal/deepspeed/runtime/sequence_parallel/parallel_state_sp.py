"""``deepspeed.runtime.sequence_parallel.parallel_state_sp``: the sequence-parallel
``mpu`` that ``UlyssesSPAttentionHF.register_with_transformers`` returns and
``deepspeed.initialize(mpu=...)`` takes.

:func:`initialize_sequence_parallel` builds the torch.distributed groups of S
consecutive ranks (DeepSpeed's layout and zeal's mesh's: :func:`zeal.dist.mesh.layout`
with no tensor or pipeline parallelism), so a data loader adapter can use them before
any engine exists. ``get_model_parallel_*`` are the sequence-parallel ones, as in
DeepSpeed (Megatron's mpu names, which DeepSpeed's engine reads for the sp size)."""

from __future__ import annotations

from typing import Any

_STATE: dict[str, Any] = {}


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Build the sp groups (consecutive ranks) and the sequence-data group (the world)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("initialize_sequence_parallel: torch.distributed is not initialized "
                           "(call deepspeed.init_distributed() first)")
    world, rank, sp = dist.get_world_size(), dist.get_rank(), int(sequence_parallel_size)
    if sp <= 1:
        raise ValueError(f"sequence_parallel_size must be greater than 1, got {sp}")
    if world % sp:
        raise RuntimeError(f"world_size ({world}) is not divisible by sequence_parallel_size {sp}")
    if _STATE:
        if _STATE["size"] == sp:
            return  # the same layout asked again (one registration per model)
        raise RuntimeError(f"sequence parallel groups already initialized with size {_STATE['size']}, not {sp}")
    mine = None
    for start in range(0, world, sp):  # every rank creates every group (a collective call)
        group = dist.new_group(list(range(start, start + sp)))
        if start <= rank < start + sp:
            mine = group
    _STATE.update(size=sp, group=mine, rank=rank % sp)


def _release_sequence_parallel_groups() -> None:
    """Forget the groups (after the world is torn down)."""
    _STATE.clear()


def is_initialized() -> bool:
    return bool(_STATE)


def _get(key: str) -> Any:
    if not _STATE:
        raise AssertionError("sequence parallel group is not initialized")
    return _STATE[key]


def get_sequence_parallel_group() -> Any:
    """The caller's sp group (S consecutive ranks)."""
    return _get("group")


def get_sequence_parallel_world_size() -> int:
    return int(_get("size"))


def get_sequence_parallel_rank() -> int:
    return int(_get("rank"))


def get_sequence_data_parallel_group() -> Any:
    """Data × sequence parallel ranks: the world (no tensor or pipeline parallelism)."""
    import torch.distributed as dist

    _get("size")
    return dist.group.WORLD


def get_sequence_data_parallel_world_size() -> int:
    import torch.distributed as dist

    _get("size")
    return dist.get_world_size()


def get_sequence_data_parallel_rank() -> int:
    import torch.distributed as dist

    _get("size")
    return dist.get_rank()


get_model_parallel_rank = get_sequence_parallel_rank
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_group = get_sequence_parallel_group
