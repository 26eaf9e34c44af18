"""Run a function on N real gloo ranks (CPU) and collect what each returns.

Every rank is a spawned process with torchrun's variables set; a rank that raises
fails the whole run at once (the others are killed), and the run has a deadline,
so a hang fails fast instead of eating CI."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable, rank: int, world: int, local_world: int, port: int, args: tuple, q) -> None:
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank % local_world), "LOCAL_WORLD_SIZE": str(local_world), "OMP_NUM_THREADS": "1",
    })
    try:
        import torch

        torch.set_num_threads(1)
        out = _plain(fn(rank, world, *args))
        q.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - report anything to the parent
        q.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _plain(obj: Any) -> Any:
    """Tensors → numpy arrays, so results travel as plain bytes (no shared-memory handles)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().float().numpy() if obj.is_floating_point() else obj.detach().cpu().numpy()
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(v) for v in obj)
    return obj


def run_ranks(fn: Callable, world: int, *args: Any, timeout: float = 180.0, local_world: int | None = None) -> list:
    """``fn(rank, world, *args)`` on ``world`` processes; returns the results by rank."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world, local_world or world, port, args, q), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"ranks {sorted(set(range(world)) - set(results))} did not finish in {timeout}s")
            try:
                rank, status, payload = q.get(timeout=min(remaining, 1.0))
            except Exception:  # queue.Empty
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
