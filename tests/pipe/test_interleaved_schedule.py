"""The interleaved 1F1B schedule (Megatron's virtual pipeline) as pure lists.

References: hand-written lists for P = 2, V = 2, M = 4 (worked from the definition:
groups of P micro-batches, forwards through chunks 0..V-1, backwards V-1..0, warm-up
2·(P-s-1) + (V-1)·P), and the bubble formula (P-1)/(V·M+P-1), which a unit-time
simulation of every stage's list (a chunk's pass costing 1/V) must reproduce exactly.
"""

from __future__ import annotations

import pytest

from zeal.pipe.schedule import Step, bubble_formula, interleaved, peak_in_flight, schedule, simulate


def _kinds(steps):
    return " ".join(f"{k}{m}.{c}" for k, m, c in steps)


def test_hand_written_lists():
    assert _kinds(interleaved(0, 2, 4, 2)) == ("F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 "
                                               "B2.1 B3.1 B2.0 B3.0")
    assert _kinds(interleaved(1, 2, 4, 2)) == ("F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 "
                                               "F3.1 B3.1 B2.0 B3.0")


@pytest.mark.parametrize("stages,micro,chunks", [(2, 2, 2), (2, 4, 2), (2, 8, 3), (3, 6, 2), (4, 8, 2), (4, 4, 4)])
def test_every_pass_once_in_order(stages, micro, chunks):
    for s in range(stages):
        steps = schedule("interleaved", s, stages, micro, chunks)
        every = [Step(k, m, c) for k in "FB" for m in range(micro) for c in range(chunks)]
        assert sorted(steps) == sorted(every)
        for m in range(micro):
            for c in range(chunks):
                assert steps.index(Step("F", m, c)) < steps.index(Step("B", m, c))
        assert peak_in_flight(steps) <= min(micro * chunks, 2 * (stages - s - 1) + (chunks - 1) * stages + 1)


@pytest.mark.parametrize("stages,micro,chunks", [(2, 4, 2), (2, 8, 2), (2, 16, 2), (4, 8, 2), (4, 16, 3), (3, 6, 4)])
def test_bubble_matches_the_interleaved_formula(stages, micro, chunks):
    got = simulate("interleaved", stages, micro, chunks=chunks)["bubble"]
    assert got == pytest.approx(bubble_formula(stages, micro, chunks))
    assert got < simulate("1f1b", stages, micro)["bubble"]  # V times smaller than 1F1B's
