"""Phase timers that measure the device, not the host's launch calls.

On CUDA a host clock around ``work.wait()`` or a forward pass measures almost nothing: the
calls only enqueue work. :class:`EventClock` records a CUDA event on the current stream at
each mark instead, and turns pairs of marks into seconds only when the totals are read
(one host wait then, none while training). :class:`HostClock` is the same interface over
``time.perf_counter`` for the CPU, where the work is done when the call returns.

Use: ``t0 = clock.mark()`` … ``clock.add("forward", t0)`` … ``clock.totals()``.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from zeal.utils.streams import is_cuda


class HostClock:
    """Seconds by name from ``time.perf_counter`` marks."""

    def __init__(self) -> None:
        self._totals: dict[str, float] = defaultdict(float)

    def mark(self) -> float:
        return time.perf_counter()

    def add(self, name: str, start: float, end: float | None = None) -> None:
        """Add the interval from ``start`` to ``end`` (a mark; now when None) to ``name``."""
        self._totals[name] += (self.mark() if end is None else end) - start

    def totals(self) -> dict[str, float]:
        return dict(self._totals)

    def total(self, name: str) -> float:
        return self._totals.get(name, 0.0)


class EventClock:
    """Seconds by name from CUDA events recorded on the current stream of ``device``."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._totals: dict[str, float] = defaultdict(float)
        self._open: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def mark(self) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def add(self, name: str, start: torch.cuda.Event, end: torch.cuda.Event | None = None) -> None:
        self._open.append((name, start, self.mark() if end is None else end))
        if len(self._open) >= 256:  # a timer nobody reads must not hold events without bound
            self._settle(block=False)

    def _settle(self, block: bool = True) -> None:
        """Turn recorded pairs into seconds: all of them (waiting), or those already reached."""
        keep = []
        for name, start, end in self._open:
            if block:
                end.synchronize()
            elif not end.query():
                keep.append((name, start, end))
                continue
            self._totals[name] += start.elapsed_time(end) / 1e3
        self._open = keep

    def totals(self) -> dict[str, float]:
        self._settle()
        return dict(self._totals)

    def total(self, name: str) -> float:
        self._settle()
        return self._totals.get(name, 0.0)


def make_clock(device: torch.device | str) -> HostClock | EventClock:
    """CUDA events on a CUDA device, the host clock elsewhere."""
    return EventClock(device) if is_cuda(device) else HostClock()
