"""Run a function on N real gloo ranks (CPU) and collect what each returns.

Every rank is a fresh process with torchrun's variables set; a rank that raises
fails the whole run at once (the others are killed), and the run has a deadline,
so a hang fails fast instead of eating CI.

Ranks are forked from a forkserver that has torch, torch._dynamo (imported lazily by the
first optimizer step) and zeal's training and serving stacks imported once per test
session, so a rank starts in milliseconds instead of the seconds an interpreter start
and ``import torch`` cost, yet begins from the state those imports leave: nothing a
previous run did is visible. The parent's current environment and working directory are
the rank's. ``ZEAL_TEST_SPAWN=1`` starts every rank as a new interpreter instead.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

from zeal.dist.launch import free_port, rank_env  # noqa: F401 - free_port: re-exported for tests

# Imported once in the forkserver, before any rank is forked from it (each saves seconds
# per rank; a module that fails to import is skipped). The two Hugging Face models are the
# references of many rank tests (importing one costs about 4 s).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "numpy", "zeal.train.build", "zeal.checkpoint",
           "zeal.inference", "tests.dist_harness", "transformers.models.llama.modeling_llama",
           "transformers.models.gpt2.modeling_gpt2"]


def _context():
    """The multiprocessing context ranks start from (see the module's docstring)."""
    if os.environ.get("ZEAL_TEST_SPAWN") == "1" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # no effect once the server runs (one server per process)
    return ctx


def _environment(env: dict[str, str]) -> None:
    """The parent's environment as it was at the call (a forked rank has the server's)."""
    os.environ.clear()
    os.environ.update(env)


def _child(fn: Callable, rank: int, world: int, local_world: int, port: int, args: tuple, q,
           env: dict[str, str]) -> None:
    _environment(env)
    os.environ.update(rank_env(rank, world, port, local_world=local_world, threads=1))
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
    ctx = _context()
    q = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_child, args=(fn, r, world, local_world or world, port, args, q, env), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = _collect(q, procs, timeout)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return results


def _collect(q, procs: list, timeout: float) -> list:
    """Each rank's result from ``q`` by rank; raises on the first error, a dead rank, or
    when ``timeout`` seconds pass."""
    world = len(procs)
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
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
    return [results[r] for r in range(world)]


def _pool_child(rank: int, world: int, port: int, inbox, outbox, env: dict[str, str]) -> None:
    _environment(env)
    os.environ.update(rank_env(rank, world, port, threads=1))
    import torch

    torch.set_num_threads(1)
    while True:
        task = inbox.get()
        if task is None:
            break
        fn, args = task
        try:
            outbox.put((rank, "ok", _plain(fn(rank, world, *args))))
        except BaseException:  # noqa: BLE001 - report anything to the parent
            outbox.put((rank, "error", traceback.format_exc()))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


class RankPool:
    """``world`` gloo ranks kept alive across calls, so that many small distributed runs
    (a property test's examples) pay the process start-up once. ``run(fn, *args)`` runs
    ``fn(rank, world, *args)`` on every rank with a deadline; after a failure or a
    time-out the pool is closed (a rank may be stuck in a collective) and restarts on
    the next call."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._procs: list = []

    def _start(self) -> None:
        ctx = _context()
        port = free_port()
        self._inboxes = [ctx.Queue() for _ in range(self.world)]
        self._outbox = ctx.Queue()
        env = dict(os.environ)
        self._procs = [ctx.Process(target=_pool_child, args=(r, self.world, port, self._inboxes[r], self._outbox,
                                                              env), daemon=True) for r in range(self.world)]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable, *args: Any, timeout: float = 60.0) -> list:
        if not self._procs:
            self._start()
        for box in self._inboxes:
            box.put((fn, args))
        try:
            return _collect(self._outbox, self._procs, timeout)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for box in getattr(self, "_inboxes", []):
            box.put(None)
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []
