"""Pipeline schedules as pure step lists (no ranks, no tensors).

A schedule says, for one stage, the order in which it runs the forward (``"F"``) and
backward (``"B"``) passes of the ``M`` micro-batches of one optimizer step:

* GPipe: every forward, then every backward (in micro-batch order). A stage keeps all
  ``M`` micro-batches' activations alive at once.
* 1F1B (PipeDream-Flush, DeepSpeed's TrainSchedule): stage ``s`` of ``P`` first runs
  ``min(P - s - 1, M)`` warm-up forwards, then alternates one forward and one backward,
  then drains the remaining backwards. At most ``P - s`` micro-batches are in flight.

The receive/send each step implies is fixed by its position (a forward receives from
the previous stage and sends to the next; a backward the reverse), so the engine only
walks the list. :func:`simulate` plays the lists of all stages with unit-time passes
(a backward costing ``backward_cost`` forwards) to measure the bubble.
"""

from __future__ import annotations

from typing import NamedTuple


class Step(NamedTuple):
    """One pass of one micro-batch: ``kind`` is "F" (forward) or "B" (backward)."""

    kind: str
    micro: int


def gpipe(stage: int, stages: int, micro_batches: int) -> list[Step]:
    """All forwards, then all backwards."""
    _check(stage, stages, micro_batches)
    return [Step("F", m) for m in range(micro_batches)] + [Step("B", m) for m in range(micro_batches)]


def one_f_one_b(stage: int, stages: int, micro_batches: int) -> list[Step]:
    """Warm-up forwards, alternating forward/backward, then the remaining backwards."""
    _check(stage, stages, micro_batches)
    warmup = min(stages - stage - 1, micro_batches)
    steps = [Step("F", m) for m in range(warmup)]
    for i in range(micro_batches - warmup):
        steps += [Step("F", warmup + i), Step("B", i)]
    steps += [Step("B", m) for m in range(micro_batches - warmup, micro_batches)]
    return steps


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def schedule(name: str, stage: int, stages: int, micro_batches: int) -> list[Step]:
    """The step list of ``name`` ("1f1b" or "gpipe") for ``stage``."""
    try:
        fn = SCHEDULES[name]
    except KeyError:
        raise ValueError(f"pipeline_parallel.schedule {name!r} is not implemented; "
                         f"use one of {sorted(SCHEDULES)}") from None
    return fn(stage, stages, micro_batches)


def peak_in_flight(steps: list[Step]) -> int:
    """The most micro-batches whose forward ran and whose backward has not."""
    live = peak = 0
    for s in steps:
        live += 1 if s.kind == "F" else -1
        peak = max(peak, live)
    return peak


def bubble_formula(stages: int, micro_batches: int) -> float:
    """The idle fraction of a flushed pipeline: (P - 1) / (M + P - 1)."""
    return (stages - 1) / (micro_batches + stages - 1)


def simulate(name: str, stages: int, micro_batches: int, backward_cost: float = 2.0) -> dict:
    """Play every stage's list with a forward taking 1 and a backward ``backward_cost``;
    a pass starts when its input exists (the previous stage's forward, the next stage's
    backward) and the stage is free. Returns the makespan and the bubble fraction
    (idle time over stage time)."""
    lists = [schedule(name, s, stages, micro_batches) for s in range(stages)]
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * stages
    pos = [0] * stages
    while any(pos[s] < len(lists[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if pos[s] == len(lists[s]):
                continue
            kind, m = lists[s][pos[s]]
            dep = ("F", s - 1, m) if kind == "F" else ("B", s + 1, m)
            if kind == "F" and s == 0 or kind == "B" and s == stages - 1:
                dep = ("F", s, m) if kind == "B" else None
            if dep is not None and dep not in done:
                continue
            start = max(free[s], done[dep] if dep else 0.0)
            free[s] = done[(kind, s, m)] = start + (1.0 if kind == "F" else backward_cost)
            pos[s] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {name} deadlocks at P={stages}, M={micro_batches}")
    span = max(free)
    busy = micro_batches * (1.0 + backward_cost)
    return {"makespan": span, "bubble": 1.0 - busy / span}


def _check(stage: int, stages: int, micro_batches: int) -> None:
    if stages < 1 or micro_batches < 1 or not 0 <= stage < stages:
        raise ValueError(f"no schedule for stage {stage} of {stages} with {micro_batches} micro-batches")
