"""ZeRO-3's gathers (prefetch included) and reduce-scatters are issued on their own streams:
each side stream first waits for the compute issued so far, the collective is issued inside
it, an event is recorded, and the compute stream waits on that event only when it needs the
result (the handle's ``wait()``). Checked with fake streams that record every call, on a real
stage-3 training step (the CPU's streams are the identity, so nothing else changes)."""

from __future__ import annotations

import torch

import zeal
from tests.train.models import TinyNet, make_batches


class Ev:
    def __init__(self, n: int, stream: str) -> None:
        self.n, self.stream = n, stream


class Rec:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def __enter__(self):
        self.log.append(("enter", self.name))
        return self

    def __exit__(self, *exc):
        self.log.append(("exit", self.name))

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, ev):
        self.log.append(("wait_event", self.name, ev.n))

    def record_event(self):
        ev = Ev(sum(1 for e in self.log if e[0] == "record"), self.name)
        self.log.append(("record", self.name, ev.n))
        return ev

    def keep(self, t):
        self.log.append(("keep", self.name))


def test_gathers_and_reduce_scatters_run_on_side_streams_ordered_by_events():
    torch.manual_seed(0)
    engine = zeal.initialize(TinyNet(blocks=2), {"train_micro_batch_size_per_gpu": 2,
                                                 "zero_optimization": {"stage": 3,
                                                                       "stage3_param_persistence_threshold": 0},
                                                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    coll = engine._p.coordinator.coll
    log: list = []
    coll.new_stream = lambda device: Rec(f"s{len(coll.streams)}", log)
    coll.current = lambda device: Rec("compute", log)
    coll.streams.clear()
    for step in make_batches(2, 2, 1, 1):
        engine.backward(engine(step[0][0]))
        engine.step()
    names = {k: s.name for k, s in coll.streams.items()}
    assert set(names) == {"gather", "reduce"}
    for kind, name in names.items():
        entered = [i for i, e in enumerate(log) if e == ("enter", name)]
        assert len(entered) >= 2, kind
        for i in entered:  # the side stream waits for compute, then the collective is issued inside it
            assert log[i - 1] == ("wait_stream", name, "compute")
            j = log.index(("exit", name), i)
            assert ("enter", name) not in log[i + 1:j]
            assert log[j + 1:j + 2] == [("keep", name)] and log[j + 1 + (kind == "reduce") + 1][:2] == ("record", name)
        recorded = [e[2] for e in log if e[:2] == ("record", name)]
        waited = [e[2] for e in log if e[:2] == ("wait_event", "compute")]
        assert len(recorded) == len(entered)
        # every collective's event is waited on by compute, after it was recorded
        for n in recorded:
            rec_at = log.index(("record", name, n))
            waits = [i for i, e in enumerate(log) if e == ("wait_event", "compute", n)]
            assert waits and all(w > rec_at for w in waits)
        assert waited
    engine.close()
