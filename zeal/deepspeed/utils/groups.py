"""``deepspeed.utils.groups``: the data / model / expert parallel groups of the job.

Answers from the mesh of the engine ``deepspeed.initialize`` built last (while it lives) (:mod:`zeal.dist.mesh`);
before any engine exists, from torch.distributed's world (everything data parallel).
Group-valued functions return torch.distributed process groups (None: the world, or a
group of one at world size 1)."""

from __future__ import annotations

from typing import Any


def _mesh() -> Any:
    from zeal.deepspeed import engine as facade
    from zeal.train.engine import live_engines

    last = facade._last() if facade._last is not None else None
    engines = live_engines()
    if last is not None and any(e is last for e in engines):
        return last.mesh
    return engines[0].mesh if engines else None


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _size(dim: str) -> int:
    m = _mesh()
    if m is None:
        return _world()[1] if dim == "dp" else 1
    return m.sizes.get(dim, 1)


def _rank(dim: str) -> int:
    m = _mesh()
    if m is None:
        return _world()[0] if dim == "dp" else 0
    return m.coords.get(dim, 0)


def _group(dim: str) -> Any:
    m = _mesh()
    if m is None:
        import torch.distributed as dist

        return dist.group.WORLD if dim == "dp" and dist.is_initialized() else None
    return m.comm(dim).group


def _get_data_parallel_world_size() -> int:
    """Ranks reading different samples: those holding a replica (ZeRO shards count as one
    data-parallel group) over the sequence-parallel size, as DeepSpeed counts them."""
    m = _mesh()
    return m.data_size if m is not None else _size("dp")


def _get_data_parallel_rank() -> int:
    m = _mesh()
    return m.data_rank if m is not None else _rank("dp")


def _get_data_parallel_group() -> Any:
    m = _mesh()
    return m.data.group if m is not None else _group("dp")


def _get_model_parallel_world_size() -> int:
    """Tensor-parallel ranks (zeal's model parallelism)."""
    return _size("tp")


def _get_expert_parallel_world_size(group_name: str | None = None) -> int:
    return _size("ep")


def _get_expert_parallel_rank(group_name: str | None = None) -> int:
    return _rank("ep")


def _get_expert_parallel_group(group_name: str | None = None) -> Any:
    return _group("ep")


def _get_expert_data_parallel_world_size(group_name: str | None = None) -> int:
    return _size("edp") if _mesh() is not None and "edp" in _mesh().sizes else _size("dp") // max(_size("ep"), 1)


def _get_expert_data_parallel_rank(group_name: str | None = None) -> int:
    return _rank("edp") if _mesh() is not None and "edp" in _mesh().coords else _rank("dp") // max(_size("ep"), 1)


def _get_sequence_parallel_world_size() -> int:
    """Ranks sharing each sequence (DeepSpeed-Ulysses' ``sequence_parallel_size``)."""
    return _size("sp")


def _get_sequence_parallel_rank() -> int:
    return _rank("sp")


def _get_sequence_parallel_group() -> Any:
    return _group("sp")


def _get_sequence_data_parallel_group() -> Any:
    """Data × sequence parallel ranks: the group ZeRO shards over."""
    return _group("dp")


def _get_sequence_data_parallel_world_size() -> int:
    return _size("dp")


def _get_sequence_data_parallel_rank() -> int:
    return _rank("dp")


def _get_broadcast_src_rank() -> int:
    return 0


def get_data_parallel_world_size() -> int:
    return _get_data_parallel_world_size()


def get_data_parallel_rank() -> int:
    return _get_data_parallel_rank()


def get_data_parallel_group() -> Any:
    return _get_data_parallel_group()


def get_sequence_parallel_world_size() -> int:
    return _get_sequence_parallel_world_size()


def get_sequence_parallel_rank() -> int:
    return _get_sequence_parallel_rank()


def get_sequence_parallel_group() -> Any:
    return _get_sequence_parallel_group()


def get_sequence_data_parallel_group() -> Any:
    return _get_sequence_data_parallel_group()


def get_tensor_model_parallel_world_size() -> int:
    return _size("tp")


def get_tensor_model_parallel_rank() -> int:
    return _rank("tp")


def get_tensor_model_parallel_group() -> Any:
    return _group("tp")


def get_model_parallel_world_size() -> int:
    return _size("tp")


def get_model_parallel_rank() -> int:
    return _rank("tp")


def get_model_parallel_group() -> Any:
    return _group("tp")
