"""Start torch.distributed from the torchrun environment, or run as one process."""

from __future__ import annotations

import atexit
import datetime
import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    """Where this process sits. ``group`` is None when running alone (world size 1),
    in which case every collective is skipped by :class:`zeal.dist.Comm`."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    group: dist.ProcessGroup | None

    @property
    def node(self) -> int:
        return self.rank // self.local_world_size

    def node_of(self, rank: int) -> int:
        return rank // self.local_world_size


def init_distributed(
    backend: str | None = None, local_world_size: int | None = None, timeout_s: float | None = None
) -> DistContext:
    """Join the job described by torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR ...).

    With no such variables and no initialised process group, returns a world-size-1
    context. The backend is NCCL when CUDA is available, gloo otherwise. A collective
    waits at most ``timeout_s`` (``ZEAL_COMM_TIMEOUT_S`` overrides it; default 600 s),
    then fails and leaves its hang-forensics records (:mod:`zeal.dist.forensics`).
    """
    cuda = torch.cuda.is_available()
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        backend = backend or ("nccl" if cuda else "gloo")
        from zeal.dist.forensics import comm_timeout_s

        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=comm_timeout_s(timeout_s)))
        # We started it, so we shut it down: a process that exits with the group's worker
        # threads still running can abort in C++ ("terminate called without an active exception").
        atexit.register(_shutdown)
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        group = dist.group.WORLD if world > 1 else None
    else:
        rank, world, group = 0, 1, None
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    lws = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % lws:
        raise ValueError(f"local_world_size {lws} does not divide world size {world}")
    if cuda:
        if dist.is_initialized() and dist.get_backend() == "gloo":
            raise ValueError("torch.distributed backend gloo with CUDA tensors is not supported (gloo moves host "
                             "memory): use nccl, or hide the GPUs (CUDA_VISIBLE_DEVICES=) to run on CPU with gloo")
        check_gpu_ranks(max(lws, local_rank + 1))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return DistContext(rank, world, local_rank, lws, device, group)


def check_gpu_ranks(per_node: int, gpus: int | None = None) -> None:
    """Refuse more processes per node than visible GPUs (NCCL needs one GPU per rank; two
    ranks on one device abort at the first collective). ``gpus``: the count to check
    against (default: ``torch.cuda.device_count()``); nothing to check without CUDA."""
    if gpus is None:
        if not torch.cuda.is_available():
            return
        gpus = torch.cuda.device_count()
    if per_node > gpus:
        raise ValueError(f"{per_node} processes per node but {gpus} GPU(s) visible: each rank needs a GPU of its "
                         f"own (NCCL); start at most {gpus} (e.g. --nproc {gpus}), or hide the GPUs "
                         "(CUDA_VISIBLE_DEVICES=) to run on CPU")


_before_shutdown: list = []


def before_shutdown(fn) -> None:
    """Run ``fn()`` at exit before the process group zeal started is destroyed."""
    _before_shutdown.append(fn)


def _shutdown() -> None:
    # Engines still referenced by the script's globals hold collectives' state; release
    # them first (without this, a stage-3 run exiting with prefetch state could abort).
    for fn in _before_shutdown:
        try:
            fn()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass
    gc.collect()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass
