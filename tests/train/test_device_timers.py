"""wall_clock_breakdown and the ZeRO-3 gather wait timer go through a clock chosen by device:
CUDA events on CUDA (a host clock around ``work.wait()`` or a forward measures only the
enqueueing there, W3), ``perf_counter`` on CPU. Checked with a fake clock that records which
phases were timed, and with the CPU clock's values."""

from __future__ import annotations

import torch

import zeal
from tests.train.models import TinyNet, make_batches
from zeal.utils.timers import EventClock, HostClock, make_clock


class FakeClock:
    def __init__(self) -> None:
        self.marks, self.added = 0, []

    def mark(self):
        self.marks += 1
        return self.marks

    def add(self, name, start, end=None):
        self.added.append(name)

    def totals(self):
        return {n: float(self.added.count(n)) for n in self.added}

    def total(self, name):
        return float(self.added.count(name))


def _engine(stage: int):
    torch.manual_seed(0)
    return zeal.initialize(TinyNet(), {"train_micro_batch_size_per_gpu": 2, "wall_clock_breakdown": True,
                                       "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                                       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})


def test_clock_by_device():
    assert isinstance(make_clock("cpu"), HostClock)
    assert isinstance(make_clock(torch.device("cuda", 0)), EventClock if torch.cuda.is_available() else HostClock)
    c = HostClock()
    t0 = c.mark()
    c.add("x", t0, t0 + 0.5)
    c.add("x", c.mark())
    assert 0.5 <= c.total("x") < 1.0 and c.totals() == {"x": c.total("x")}


def test_engine_phases_and_gather_wait_use_the_device_clock():
    engine = _engine(3)
    engine._clock = FakeClock()
    engine._p.coordinator._clock = fake_gather = FakeClock()
    for step in make_batches(2, 2, 1, 1):
        engine.backward(engine(step[0][0]))
        engine.step()
    out = engine.wall_clock_breakdown()
    assert out["forward"] == out["backward"] == out["reduce"] == out["step"] == 2.0
    assert fake_gather.added and set(fake_gather.added) == {"gather"}
    assert out["gather"] == float(len(fake_gather.added))
    engine.close()


def test_cpu_breakdown_is_in_seconds():
    engine = _engine(3)
    for step in make_batches(1, 2, 1, 1):
        engine.backward(engine(step[0][0]))
        engine.step()
    out = engine.wall_clock_breakdown()
    assert {"forward", "backward", "reduce", "step", "gather"} <= out.keys()
    assert all(0 <= v < 30 for v in out.values()) and out["forward"] > 0
    engine.close()
