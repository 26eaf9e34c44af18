"""Helpers the benchmark scripts share. Plain file, importable from the DeepSpeed
environment too (which has no zeal installed): scripts put ``bench/`` on sys.path."""

from __future__ import annotations

import glob
import importlib.util
import multiprocessing as mp
import os
import resource
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load_gpt():
    """zeal's GPT module loaded from its file, so every environment trains exactly the
    same model code. Returns (GPT, GPTConfig)."""
    path = REPO / "zeal" / "models" / "gpt.py"
    if str(REPO) not in sys.path:  # gpt.py imports zeal.models.checkpointing
        sys.path.insert(0, str(REPO))
    spec = importlib.util.spec_from_file_location("_bench_gpt", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["_bench_gpt"] = mod
    spec.loader.exec_module(mod)
    return mod.GPT, mod.GPTConfig


def peak_rss_mib() -> float:
    """This process's peak resident set size in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def clear_stale_extension_locks(min_age_s: float = 900) -> None:
    """A killed DeepSpeed op build leaves a ``lock`` that makes every later build wait forever.
    Locks younger than ``min_age_s`` may belong to a build running now and are kept (a
    script clears them at once, with ``min_age_s=0``, after killing one of its own jobs)."""
    for lock in glob.glob(os.path.expanduser("~/.cache/torch_extensions/**/lock"), recursive=True):
        try:
            age = time.time() - os.path.getmtime(lock)
        except OSError:
            continue
        if age >= min_age_s:
            print(f"# removing stale extension lock {lock} ({age:.0f} s old)", flush=True)
            os.remove(lock)
        else:
            print(f"# keeping extension lock {lock} ({age:.0f} s old: a build may be running)", flush=True)


def timed_step(engine, x):
    """One DeepSpeed-style step (forward with ``labels=x``, backward, step) on a zeal or
    DeepSpeed engine. Returns (loss, forward_s, backward_s, step_s)."""
    t0 = time.perf_counter()
    loss = engine(x, labels=x)
    t1 = time.perf_counter()
    engine.backward(loss)
    t2 = time.perf_counter()
    engine.step()
    return loss, t1 - t0, t2 - t1, time.perf_counter() - t2


def spawn_ranks(target, world: int, args: Callable[[int, int, object], tuple]) -> tuple[list, object]:
    """Start ``world`` spawned processes, rank ``r`` running ``target(*args(r, port, queue))``
    (``port``: a free loopback port for the process group; ``queue``: what they report on).
    Returns the processes (started) and the queue."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=args(r, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    return procs, q
