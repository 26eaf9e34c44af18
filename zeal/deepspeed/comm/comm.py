"""``deepspeed.comm``: torch.distributed under DeepSpeed's names.

:func:`init_distributed` joins the job the launcher describes (torchrun's or ``zeal
deepspeed``'s RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT) at any world size, 1
included, so ``torch.distributed.get_rank()`` works after it as after DeepSpeed's.
Alone (no launcher variables) it starts a one-process group that needs no port. The
collectives are torch.distributed's with DeepSpeed's signatures (``prof``,
``log_name`` ... accepted and ignored).
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp
_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: datetime.timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Start torch.distributed if it is not started (DeepSpeed's ``init_distributed``).

    ``dist_backend`` defaults to the accelerator's (``nccl`` on GPUs, ``gloo`` on the CPU;
    ``nccl`` without CUDA becomes ``gloo``). With the launcher's variables set the group
    is the launcher's job (``init_method`` default ``env://``); with ``init_method``,
    ``rank`` and ``world_size`` it is that job; with neither, a one-process job
    (RANK=0, WORLD_SIZE=1, LOCAL_RANK=0 set in the environment). ``dist_init_required=False``
    with no group started is an error, as in DeepSpeed. ``auto_mpi_discovery``,
    ``verbose`` and ``config`` are accepted (zeal does not probe MPI)."""
    del auto_mpi_discovery, verbose, config
    if dist.is_initialized():
        return
    if dist_init_required is False:
        raise RuntimeError("deepspeed.init_distributed(dist_init_required=False): torch.distributed is not "
                           "initialized; pass dist_init_required=True or start it before")
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend in ("nccl", "ccl", "hccl", "xccl") and not torch.cuda.is_available():
        backend = "gloo"
    from zeal.dist.forensics import comm_timeout_s

    timeout = timeout or datetime.timedelta(seconds=comm_timeout_s(None))
    launched = all(k in os.environ for k in _ENV)
    if init_method is None and not launched and rank < 0:
        for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
            os.environ.setdefault(key, value)
        if int(os.environ["WORLD_SIZE"]) != 1:
            raise RuntimeError("deepspeed.init_distributed: WORLD_SIZE > 1 but MASTER_ADDR/MASTER_PORT are not set; "
                               "start the ranks with `zeal deepspeed` or torchrun")
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    elif init_method is None and not launched:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    else:
        kw: dict[str, Any] = {"rank": rank, "world_size": world_size} if rank >= 0 else {}
        dist.init_process_group(backend, init_method=init_method, timeout=timeout, **kw)
    import atexit

    from zeal.dist.context import _shutdown

    atexit.register(_shutdown)  # we started it, so we end it (after live engines are closed)


def _need() -> None:
    if not dist.is_initialized():
        raise RuntimeError("deepspeed.comm: torch.distributed is not initialized; call deepspeed.init_distributed() "
                           "(deepspeed.initialize does it)")


def is_available() -> bool:
    return dist.is_available()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (default: the job)."""
    _need()
    return dist.get_rank(group)


def get_world_size(group: Any = None) -> int:
    """Processes in ``group`` (default: the job)."""
    _need()
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """This process's rank on its node (the launcher's LOCAL_RANK; 0 without one)."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)))


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    """The job rank of ``group``'s rank ``group_rank``."""
    _need()
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    """The job ranks of every member of ``group``, in group order."""
    _need()
    return list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)


def get_backend(group: Any = None) -> str:
    _need()
    return dist.get_backend(group)


def get_world_group() -> Any:
    _need()
    return dist.group.WORLD


def new_group(ranks: list[int]) -> Any:
    """A sub-group of ``ranks`` (every process calls it)."""
    _need()
    return dist.new_group(ranks)


def destroy_process_group(group: Any = None) -> None:
    if dist.is_initialized():
        dist.destroy_process_group(group)


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None, prof: bool = False,
            log_name: str = "barrier", debug: Any = None) -> Any:
    _need()
    return dist.barrier(group=group, async_op=async_op)


def monitored_barrier(group: Any = None, timeout: datetime.timedelta | None = None, wait_all_ranks: bool = False) -> Any:
    _need()
    return dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
               prof: bool = False, log_name: str = "all_reduce", debug: Any = None) -> Any:
    """Reduce ``tensor`` over ``group`` in place (``op``: ``ReduceOp.SUM`` by default)."""
    _need()
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def inference_all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
                         prof: bool = False, log_name: str = "all_reduce", debug: Any = None) -> Any:
    """:func:`all_reduce` (DeepSpeed's inference variant; the same result)."""
    return all_reduce(tensor, op, group, async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False, prof: bool = False,
              log_name: str = "broadcast", debug: Any = None) -> Any:
    _need()
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False,
               prof: bool = False, log_name: str = "all_gather", debug: Any = None) -> Any:
    _need()
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None,
                           async_op: bool = False, prof: bool = False, log_name: str = "all_gather_into_tensor",
                           debug: Any = None) -> Any:
    _need()
    return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: Any = None, async_op: bool = False, prof: bool = False,
                          log_name: str = "reduce_scatter_tensor", debug: Any = None) -> Any:
    _need()
    if dist.get_backend(group) == "gloo":  # gloo has no reduce-scatter: reduce, then keep this rank's slice
        full = input_tensor.clone()
        dist.all_reduce(full, op=op, group=group)
        n = output_tensor.numel()
        output_tensor.copy_(full.view(-1)[dist.get_rank(group) * n:(dist.get_rank(group) + 1) * n].view_as(output_tensor))
        return None
    return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes: Any = None,
                      input_split_sizes: Any = None, group: Any = None, async_op: bool = False, prof: bool = False,
                      log_name: str = "all_to_all_single", debug: Any = None) -> Any:
    _need()
    return dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group=group,
                                  async_op=async_op)


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
           prof: bool = False, log_name: str = "reduce", debug: Any = None) -> Any:
    _need()
    return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def gather(tensor: torch.Tensor, gather_list: Any = None, dst: int = 0, group: Any = None, async_op: bool = False,
           prof: bool = False, log_name: str = "gather", debug: Any = None) -> Any:
    _need()
    return dist.gather(tensor, gather_list, dst, group=group, async_op=async_op)


def scatter(tensor: torch.Tensor, scatter_list: Any = None, src: int = 0, group: Any = None, async_op: bool = False,
            prof: bool = False, log_name: str = "scatter", debug: Any = None) -> Any:
    _need()
    return dist.scatter(tensor, scatter_list, src, group=group, async_op=async_op)


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, prof: bool = False,
         log_name: str = "send", debug: Any = None) -> None:
    _need()
    dist.send(tensor, dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0, prof: bool = False,
         log_name: str = "recv", debug: Any = None) -> int:
    _need()
    return dist.recv(tensor, src, group=group, tag=tag)


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, prof: bool = False,
          log_name: str = "isend", debug: Any = None) -> Any:
    _need()
    return dist.isend(tensor, dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0, prof: bool = False,
          log_name: str = "irecv", debug: Any = None) -> Any:
    _need()
    return dist.irecv(tensor, src, group=group, tag=tag)


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> Any:
    """DeepSpeed's comms-logger summary. zeal accounts bytes per engine instead:
    ``engine.comm_stats()``; this returns an empty summary."""
    return {} if return_dict else None
