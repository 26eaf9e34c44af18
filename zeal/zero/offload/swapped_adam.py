"""Adam whose fp32 master parameters and moments live on disk (ZeRO-Infinity optimizer tier).

A flat master shard of ``numel`` elements is cut into sub-groups of at most
``sub_group_size`` elements. Each sub-group has three swap tensors in a
:class:`SwapStore`: ``param.{i}``, ``exp_avg.{i}``, ``exp_avg_sq.{i}`` (and
``grad.{i}`` when gradients are swapped too). The step streams sub-groups through a
fixed pool of ``buffer_count`` page-aligned buffers of one sub-group each; a
sub-group in flight takes one buffer per swap tensor (3, or 4 with swapped grads), so
``slots = buffer_count // 3`` sub-groups are in flight at once:

    read thread:   read 0 | read 1 | read 2 |    read 3     |    read 4     | ...
    main thread:            update 0 |    update 1   |    update 2   | ...
    write thread:                      |   write 0     |   write 1     | ...

The reads of sub-group i+slots are queued with the write-back of sub-group i (same
buffers) as their ``after`` dependency. Reads and writes run on separate threads, so
with one slot the step is sequential, with two reads overlap updates, with three or
more reads, updates and write-backs all overlap. Bytes crossing the disk per step: read and write
of 12 bytes per element (plus 4 read with swapped gradients); moments of a sub-group
that has never been updated are zero-filled instead of read.

Memory: ``buffer_count × min(sub_group_size, numel) × 4`` bytes, allocated once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from zeal.zero.offload.cpu_adam import AdamState, CPUAdam
from zeal.zero.offload.swap import OPTIMIZER_PATH_KEY, SwapStore, aligned_empty

BUFFER_COUNT_KEY = "zero_optimization.offload_optimizer.buffer_count"
STATES = ("param", "exp_avg", "exp_avg_sq")
_NAMES = (*STATES, "grad")  # buffer j of a slot holds _NAMES[j]


@dataclass
class SwapStepStats:
    """What one :meth:`SwappedAdam.step` did; ``io_wait_seconds`` is time the main
    thread sat waiting for the disk (the part of I/O not hidden behind updates)."""

    seconds: float
    io_wait_seconds: float
    compute_seconds: float
    bytes_read: int
    bytes_written: int
    sub_groups: int
    slots: int


def sub_group_ranges(numel: int, sub_group_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each sub-group; every one has ``sub_group_size`` elements but the last."""
    if sub_group_size < 1:
        raise ValueError(f"zero_optimization.sub_group_size must be >= 1, got {sub_group_size}")
    return [(lo, min(lo + sub_group_size, numel)) for lo in range(0, numel, sub_group_size)]


class SwappedAdam:
    """:class:`CPUAdam` over a flat fp32 master of ``numel`` elements kept in a SwapStore.

    Bit-identical to ``optimizer.update`` on the whole tensor in memory (the update is
    elementwise). Typical use: :meth:`write_master` once with the initial fp32 shard,
    then per step :meth:`step` with the flat fp32 gradient shard and an ``on_update``
    callback that copies each updated master chunk into the compute parameters.
    """

    def __init__(self, numel: int, optimizer: CPUAdam, nvme_path: str, *, sub_group_size: int = 10**8,
                 buffer_count: int = 9, swap_grads: bool = False, direct_io: bool = True,
                 io_parallelism: int = 4, config_key: str = OPTIMIZER_PATH_KEY) -> None:
        self.numel = numel
        self.optimizer = optimizer
        self.ranges = sub_group_ranges(numel, sub_group_size)
        self.swap_grads = swap_grads
        names = STATES + (("grad",) if swap_grads else ())
        self.per_slot = len(names)
        if buffer_count < self.per_slot:
            raise ValueError(f"{BUFFER_COUNT_KEY} must be >= {self.per_slot} (one buffer per swapped "
                             f"tensor of a sub-group: {', '.join(names)}), got {buffer_count}")
        self.slots = max(1, min(buffer_count // self.per_slot, len(self.ranges)))
        self.steps = [0] * len(self.ranges)
        sizes = {f"{s}.{i}": hi - lo for i, (lo, hi) in enumerate(self.ranges) for s in names}
        self.store = SwapStore(nvme_path, sizes, direct_io=direct_io, io_parallelism=io_parallelism,
                               config_key=config_key)
        buf_numel = max((hi - lo for lo, hi in self.ranges), default=0)
        self._buffers = [[aligned_empty(buf_numel) for _ in names] for _ in range(self.slots)]

    @property
    def cpu_bytes(self) -> int:
        """Host memory held: the buffer pool (allocated once at construction)."""
        return sum(b.numel() * b.element_size() for slot in self._buffers for b in slot)

    @property
    def disk_bytes(self) -> int:
        """Bytes of swap files on disk."""
        return self.store.nbytes

    # -- streaming access for initialisation and checkpoints --------------------------

    def _split(self, offset: int, n: int) -> Iterator[tuple[int, int, slice]]:
        """(sub-group, offset inside it, slice of the caller's chunk) covering [offset, offset+n)."""
        if offset < 0 or offset + n > self.numel:
            raise ValueError(f"[{offset}, {offset + n}) is outside the {self.numel}-element master")
        for i, (lo, hi) in enumerate(self.ranges):
            a, b = max(lo, offset), min(hi, offset + n)
            if a < b:
                yield i, a - lo, slice(a - offset, b - offset)

    def write_state(self, state: str, src: torch.Tensor, offset: int = 0) -> None:
        """Store ``src`` (fp32, flat) as elements [offset, offset+numel) of ``state``
        ("param", "exp_avg", "exp_avg_sq" or, when swapped, "grad")."""
        src = src.reshape(-1)
        futures = [self.store.write_async(f"{state}.{i}", src[sl].contiguous(), off)
                   for i, off, sl in self._split(offset, src.numel())]
        for f in futures:
            f.result()

    def read_state(self, state: str, out: torch.Tensor, offset: int = 0) -> None:
        """Fill ``out`` (fp32, contiguous) with elements [offset, offset+numel) of ``state``.
        Moments of a sub-group never updated read as zeros."""
        flat = out.view(-1)
        futures = []
        for i, off, sl in self._split(offset, flat.numel()):
            if state in ("exp_avg", "exp_avg_sq") and self.steps[i] == 0:
                flat[sl].zero_()
            else:
                futures.append(self.store.read_async(f"{state}.{i}", flat[sl], off))
        for f in futures:
            f.result()

    def write_master(self, src: torch.Tensor, offset: int = 0) -> None:
        self.write_state("param", src, offset)

    def read_master(self, out: torch.Tensor, offset: int = 0) -> None:
        self.read_state("param", out, offset)

    def set_steps(self, steps: list[int]) -> None:
        """Restore per-sub-group step counts (after loading moments with :meth:`write_state`)."""
        if len(steps) != len(self.ranges):
            raise ValueError(f"{len(steps)} step counts for {len(self.ranges)} sub-groups")
        self.steps = [int(s) for s in steps]

    # -- the step ----------------------------------------------------------------------

    def _views(self, i: int) -> list[torch.Tensor]:
        n = self.ranges[i][1] - self.ranges[i][0]
        return [b[:n] for b in self._buffers[i % self.slots]]

    def _load(self, i: int, after: list[Future]) -> list[Future]:
        """Queue the reads of sub-group i into its slot, once the slot's last write-back is done."""
        views = self._views(i)
        slots = [0] + ([1, 2] if self.steps[i] > 0 else []) + ([3] if self.swap_grads else [])
        futures = [self.store.read_async(f"{_NAMES[j]}.{i}", views[j], 0, after) for j in slots]
        if self.steps[i] == 0:  # never updated: zero moments instead of reading them
            futures.append(self.store.submit(lambda: (views[1].zero_(), views[2].zero_()), after=after))
        return futures

    def _save(self, i: int) -> list[Future]:
        views = self._views(i)
        return [self.store.write_async(f"{name}.{i}", views[j]) for j, name in enumerate(STATES)]

    def step(self, grads: torch.Tensor | None = None,
             on_update: Callable[[int, torch.Tensor], None] | None = None,
             lr: float | None = None) -> SwapStepStats:
        """One optimizer step over every sub-group.

        ``grads``: flat gradient of ``numel`` elements in memory (fp32 for bit-exactness;
        other dtypes are upcast per sub-group), or None when gradients are swapped
        (written beforehand with ``write_state("grad", ...)``). ``on_update(start,
        master_chunk)`` is called on this thread with each updated fp32 chunk, valid only
        during the call.
        """
        if (grads is None) != self.swap_grads:
            raise ValueError("pass grads exactly when the SwappedAdam was built without swap_grads")
        if grads is not None:
            grads = grads.reshape(-1)
            if grads.numel() != self.numel:
                raise ValueError(f"grads has {grads.numel()} elements, master has {self.numel}")
        t_start = time.perf_counter()
        read0, written0 = self.store.bytes_read, self.store.bytes_written
        io_wait = compute = 0.0
        pending = {i: self._load(i, []) for i in range(min(self.slots, len(self.ranges)))}
        writes: list[list[Future]] = []
        try:
            for i, (lo, hi) in enumerate(self.ranges):
                t0 = time.perf_counter()
                for f in pending.pop(i):
                    f.result()
                t1 = time.perf_counter()
                param, exp_avg, exp_avg_sq, *swapped = self._views(i)
                grad = swapped[0] if self.swap_grads else grads[lo:hi].float()
                state = AdamState(exp_avg, exp_avg_sq, self.steps[i])
                self.optimizer.update(param, grad, state, lr)
                self.steps[i] = state.step
                if on_update is not None:
                    on_update(lo, param)
                io_wait += t1 - t0
                compute += time.perf_counter() - t1
                writes.append(self._save(i))
                if i + self.slots < len(self.ranges):  # reuse this slot once its write-back is done
                    pending[i + self.slots] = self._load(i + self.slots, writes[-1])
            t0 = time.perf_counter()
            for f in (f for group in writes for f in group):
                f.result()
            io_wait += time.perf_counter() - t0
        finally:  # never leave I/O running into buffers the next call will reuse
            for f in [*(f for g in pending.values() for f in g), *(f for g in writes for f in g)]:
                f.exception()
        return SwapStepStats(time.perf_counter() - t_start, io_wait, compute,
                             self.store.bytes_read - read0, self.store.bytes_written - written0,
                             len(self.ranges), self.slots)

    def close(self) -> None:
        """Delete the swap files (they are scratch; checkpoints are the durable copy)."""
        self.store.close()

    def __enter__(self) -> SwappedAdam:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
