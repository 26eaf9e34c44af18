"""Pipeline schedules as pure step lists (no ranks, no tensors).

A schedule says, for one stage, the order in which it runs the forward (``"F"``) and
backward (``"B"``) passes of the ``M`` micro-batches of one optimizer step:

* GPipe: every forward, then every backward (in micro-batch order). A stage keeps all
  ``M`` micro-batches' activations alive at once.
* 1F1B (PipeDream-Flush, DeepSpeed's TrainSchedule): stage ``s`` of ``P`` first runs
  ``min(P - s - 1, M)`` warm-up forwards, then alternates one forward and one backward,
  then drains the remaining backwards. At most ``P - s`` micro-batches are in flight.
* Interleaved 1F1B (Megatron-LM's virtual pipeline): the model is cut into ``P·V``
  chunks and stage ``s`` holds the ``V`` chunks ``s, s + P, ...`` (its *virtual
  stages*), so a micro-batch goes round the ranks ``V`` times. The passes are taken
  in groups of ``P`` micro-batches: a group's forwards run through chunk 0, then
  chunk 1, ...; its backwards through chunk ``V - 1`` down to 0. Stage ``s`` first runs
  ``2·(P - s - 1) + (V - 1)·P`` warm-up forwards (all of them when that reaches
  ``M·V``), then alternates, then drains. Each pass is ``1/V`` of a stage's work, so
  the bubble shrinks ``V`` times: (P - 1) / (V·M + P - 1). ``M`` must be a multiple of ``P``.

The receive/send each step implies is fixed by its position (a forward receives from
the previous stage and sends to the next; a backward the reverse), so the engine only
walks the list. :func:`simulate` plays the lists of all stages with unit-time passes
(a backward costing ``backward_cost`` forwards) to measure the bubble.
"""

from __future__ import annotations

from typing import NamedTuple


class Step(NamedTuple):
    """One pass of one micro-batch: ``kind`` is "F" (forward) or "B" (backward);
    ``chunk`` the model chunk (virtual stage) of this rank it runs (0 without interleaving)."""

    kind: str
    micro: int
    chunk: int = 0


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


def interleaved(stage: int, stages: int, micro_batches: int, chunks: int) -> list[Step]:
    """Megatron's interleaved 1F1B over ``chunks`` (V) model chunks per stage; see the
    module docstring. ``micro_batches`` must be a multiple of ``stages``."""
    _check(stage, stages, micro_batches)
    if chunks < 1 or micro_batches % stages:
        raise ValueError(f"the interleaved schedule needs micro_batches ({micro_batches}) a multiple of the "
                         f"stages ({stages}) and at least one chunk (got {chunks})")
    total = micro_batches * chunks
    group = stages * chunks

    def step(kind: str, k: int) -> Step:
        chunk = (k % group) // stages
        return Step(kind, (k // group) * stages + k % stages, chunk if kind == "F" else chunks - 1 - chunk)

    warmup = min(2 * (stages - stage - 1) + (chunks - 1) * stages, total)
    steps = [step("F", k) for k in range(warmup)]
    for i in range(total - warmup):
        steps += [step("F", warmup + i), step("B", i)]
    return steps + [step("B", k) for k in range(total - warmup, total)]


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved}


def schedule(name: str, stage: int, stages: int, micro_batches: int, chunks: int = 1) -> list[Step]:
    """The step list of ``name`` ("1f1b", "gpipe" or "interleaved" with ``chunks``
    model chunks per stage) for ``stage``."""
    try:
        fn = SCHEDULES[name]
    except KeyError:
        raise ValueError(f"pipeline_parallel.schedule {name!r} is not implemented; "
                         f"use one of {sorted(SCHEDULES)}") from None
    if name == "interleaved":
        return fn(stage, stages, micro_batches, chunks)
    if chunks != 1:
        raise ValueError(f"pipeline_parallel.schedule {name!r} runs one model chunk per stage, not {chunks}")
    return fn(stage, stages, micro_batches)


def peak_in_flight(steps: list[Step]) -> int:
    """The most micro-batches whose forward ran and whose backward has not."""
    live = peak = 0
    for s in steps:
        live += 1 if s.kind == "F" else -1
        peak = max(peak, live)
    return peak


def bubble_formula(stages: int, micro_batches: int, chunks: int = 1) -> float:
    """The idle fraction of a flushed pipeline: (P - 1) / (V·M + P - 1) with ``chunks``
    (V) model chunks per stage; (P - 1) / (M + P - 1) without interleaving."""
    return (stages - 1) / (chunks * micro_batches + stages - 1)


def simulate(name: str, stages: int, micro_batches: int, backward_cost: float = 2.0, chunks: int = 1) -> dict:
    """Play every stage's list with a chunk's forward taking ``1/V`` and its backward
    ``backward_cost/V``; a pass starts when its input exists (the previous virtual
    stage's forward, the next one's backward) and the stage is free. Returns the
    makespan and the bubble fraction (idle time over stage time). Raises when the lists
    deadlock (every stage waits)."""
    lists = [schedule(name, s, stages, micro_batches, chunks) for s in range(stages)]
    last = stages * chunks - 1
    done: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, micro-batch) -> end time
    free = [0.0] * stages
    pos = [0] * stages
    while any(pos[s] < len(lists[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if pos[s] == len(lists[s]):
                continue
            kind, m, c = lists[s][pos[s]]
            v = c * stages + s
            dep = ("F", v - 1, m) if kind == "F" else ("B", v + 1, m)
            if kind == "F" and v == 0 or kind == "B" and v == last:
                dep = ("F", v, m) if kind == "B" else None
            if dep is not None and dep not in done:
                continue
            start = max(free[s], done[dep] if dep else 0.0)
            free[s] = done[(kind, v, m)] = start + (1.0 if kind == "F" else backward_cost) / chunks
            pos[s] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {name} deadlocks at P={stages}, M={micro_batches}, V={chunks}")
    span = max(free)
    busy = micro_batches * (1.0 + backward_cost)
    return {"makespan": span, "bubble": 1.0 - busy / span}


def _check(stage: int, stages: int, micro_batches: int) -> None:
    if stages < 1 or micro_batches < 1 or not 0 <= stage < stages:
        raise ValueError(f"no schedule for stage {stage} of {stages} with {micro_batches} micro-batches")
