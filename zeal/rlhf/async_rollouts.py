"""Asynchronous rollouts (``rlhf.async_rollouts: k``): the serving copy generates batch
``t + k`` in a background thread while the trainer updates on batch ``t``.

The schedule is fixed, so a run is deterministic given its seed: after the trainer's
step ``t`` (weights version ``t``) a snapshot of the weights is handed to the generator
thread, which loads it into the serving copy and then generates batch ``t + k + 1``;
that batch is trained at step ``t + k + 1`` on version ``t + k`` weights, ``k`` versions
newer than the ones that sampled it (the first ``k + 1`` batches all come from version 0).
:meth:`RolloutPipeline.get` refuses a batch more than ``k`` versions old. The generator's
log-probs are then the behaviour policy's, not the trainer's: the trainer takes its own
before the update and weights each token by the truncated ratio of the two
(:func:`zeal.rlhf.grpo_losses.mismatch_weights`). ``k = 0`` is the synchronous loop and
never uses this module.

Threads, not processes: the serving copy lives in the trainer's process (the hybrid
engine), torch releases the GIL inside its kernels, and only the weight snapshot crosses
between the two (one copy of the weights, taken on the trainer's thread). ``threads``
gives the generator thread its own intra-op thread count (torch's is per OS thread), so
that on a small CPU the two sides need not each spread over every core.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Timeline:
    """Wall-clock intervals of the generator and the trainer, to measure their overlap."""

    generate: list[tuple[float, float]] = field(default_factory=list)
    train: list[tuple[float, float]] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)

    def overlap_s(self) -> float:
        """Seconds during which both were running (each side's intervals are disjoint)."""
        return sum(max(0.0, min(a1, b1) - max(a0, b0)) for a0, a1 in self.generate for b0, b1 in self.train)

    def summary(self) -> dict[str, float]:
        """Wall time, generation and training seconds, their overlap, its share of the wall
        time, and the share of the generation seconds that ran beside training (hidden)."""
        wall = time.perf_counter() - self.t0
        ov = self.overlap_s()
        gen = sum(b - a for a, b in self.generate)
        return {"wall_s": wall, "generate_s": gen, "train_s": sum(b - a for a, b in self.train), "overlap_s": ov,
                "overlap_share": ov / max(wall, 1e-9), "hidden_generation_share": ov / max(gen, 1e-9)}


class RolloutPipeline:
    """Batches ``first..last`` made by ``produce(step, pick, version)`` on one background
    thread, ``k`` steps ahead of the trainer (see the module docstring). ``draw(step)`` is
    called on the trainer's thread in step order (the prompt picks, as the synchronous loop
    draws them); ``snapshot()`` copies the trainer's weights (trainer's thread) and
    ``load(snapshot)`` puts them into the serving copy (generator's thread)."""

    def __init__(self, k: int, first: int, last: int, produce: Callable[[int, Any, int], Any],
                 draw: Callable[[int], Any], snapshot: Callable[[], Any], load: Callable[[Any], None],
                 threads: int | None = None) -> None:
        if k < 1:
            raise ValueError(f"async_rollouts must be >= 1 for a pipeline, got {k}")
        self.k, self.last = k, last
        self.produce, self.draw, self.snapshot, self.load = produce, draw, snapshot, load
        self.threads = threads
        # the weights version in the serving copy (counted by the loads the generator made), and
        # that of the copy each batch was generated with: get() checks both against k
        self.loaded = first - 1
        self.versions: dict[int, int] = {}
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="zeal-rollouts")
        self.futures: dict[int, Future] = {}
        self.timeline = Timeline()
        self.sync_s = 0.0
        self.wait_s = 0.0
        self._submit_range(first, min(first + k, last), first - 1, None)

    def _submit_range(self, lo: int, hi: int, version: int, weights: Any) -> None:
        for j in range(lo, hi + 1):
            pick = self.draw(j)
            self.futures[j] = self.pool.submit(self._job, j, pick, version, weights if j == lo else None)

    def _job(self, step: int, pick: Any, version: int, weights: Any) -> Any:
        if self.threads:
            torch.set_num_threads(self.threads)  # this thread's own count; the trainer's is unchanged
        if weights is not None:
            t0 = time.perf_counter()
            self.load(weights)
            self.sync_s += time.perf_counter() - t0
            self.loaded = version
        self.versions[step] = self.loaded
        t0 = time.perf_counter()
        out = self.produce(step, pick, version)
        self.timeline.generate.append((t0, time.perf_counter()))
        return out

    def get(self, step: int) -> Any:
        """Batch ``step`` (waits for it); refuses one generated more than ``k`` versions ago,
        by its label and by the version counter of the serving copy that generated it."""
        t0 = time.perf_counter()
        batch = self.futures.pop(step).result()
        self.wait_s += time.perf_counter() - t0
        version = batch.version
        held = self.versions.pop(step, version)
        if step - 1 - min(version, held) > self.k:
            raise RuntimeError(f"async rollouts: batch {step} came from weights version {min(version, held)}, "
                               f"{step - 1 - min(version, held)} steps old (async_rollouts {self.k})")
        if held != version:
            raise RuntimeError(f"async rollouts: batch {step} is labelled weights version {version} but the "
                               f"serving copy held version {held}")
        return batch

    def trained(self, step: int, t_start: float) -> None:
        """The trainer finished step ``step`` (begun at ``t_start``): hand its weights to the
        generator for batch ``step + k + 1``."""
        self.timeline.train.append((t_start, time.perf_counter()))
        nxt = step + self.k + 1
        if nxt <= self.last:
            t0 = time.perf_counter()
            weights = self.snapshot()
            self.sync_s += time.perf_counter() - t0
            self._submit_range(nxt, nxt, step, weights)

    def take_sync_wait(self) -> tuple[float, float]:
        """Seconds spent on weight syncs and waiting for batches since the last call."""
        out = (self.sync_s, self.wait_s)
        self.sync_s = self.wait_s = 0.0
        return out

    def close(self) -> None:
        for f in self.futures.values():
            f.cancel()
        self.pool.shutdown(wait=True)
