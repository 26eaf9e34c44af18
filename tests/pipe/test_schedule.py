"""Pipeline schedules and partitions as pure functions (no ranks).

References: the schedules' definitions (hand-written lists), the bubble formula
(P - 1) / (M + P - 1) (a flushed pipeline with forward 1, backward 2 has exactly that
idle fraction), brute force for the balanced partition.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from zeal.pipe.module import LayerSpec, PipelineModule, partition_balanced, partition_uniform
from zeal.pipe.schedule import Step, bubble_formula, gpipe, one_f_one_b, peak_in_flight, schedule, simulate


def _kinds(steps):
    return " ".join(f"{k}{m}" + (f".{c}" if c else "") for k, m, c in steps)


def test_hand_written_lists():
    assert _kinds(one_f_one_b(0, 2, 4)) == "F0 F1 B0 F2 B1 F3 B2 B3"
    assert _kinds(one_f_one_b(1, 2, 4)) == "F0 B0 F1 B1 F2 B2 F3 B3"
    assert _kinds(one_f_one_b(0, 4, 2)) == "F0 F1 B0 B1"  # fewer micro-batches than warm-up slots
    assert _kinds(gpipe(1, 3, 3)) == "F0 F1 F2 B0 B1 B2"


@pytest.mark.parametrize("stages,micro", [(2, 1), (2, 4), (3, 5), (4, 4), (4, 16), (5, 3)])
def test_every_micro_batch_once_and_peak_memory(stages, micro):
    for s in range(stages):
        for name in ("1f1b", "gpipe"):
            steps = schedule(name, s, stages, micro)
            assert sorted(steps) == sorted([Step("F", m) for m in range(micro)] + [Step("B", m) for m in range(micro)])
            for m in range(micro):
                assert steps.index(Step("F", m)) < steps.index(Step("B", m))
            assert [m for k, m, _ in steps if k == "B"] == list(range(micro))  # backwards in order
        assert peak_in_flight(one_f_one_b(s, stages, micro)) == min(stages - s, micro) <= stages
        assert peak_in_flight(gpipe(s, stages, micro)) == micro


@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 4), (4, 8), (4, 16), (3, 7)])
def test_bubble_matches_the_formula(stages, micro):
    for name in ("1f1b", "gpipe"):
        assert simulate(name, stages, micro)["bubble"] == pytest.approx(bubble_formula(stages, micro))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="'zigzag' is not implemented"):
        schedule("zigzag", 0, 2, 4)
    with pytest.raises(ValueError, match="a multiple of the stages"):
        schedule("interleaved", 0, 2, 3, chunks=2)
    with pytest.raises(ValueError, match="runs one model chunk per stage"):
        schedule("1f1b", 0, 2, 4, chunks=2)
    with pytest.raises(ValueError, match="stage 2 of 2"):
        one_f_one_b(2, 2, 4)


def test_uniform_and_balanced_partitions():
    assert partition_uniform(7, 3) == [0, 3, 5, 7]
    weights = [5, 1, 1, 1, 8, 2, 2, 3]
    for parts in (1, 2, 3, 4):
        got = partition_balanced(weights, parts)
        best = min(max(sum(weights[a:b]) for a, b in zip(c, c[1:]))
                   for cuts in itertools.combinations(range(1, len(weights)), parts - 1)
                   for c in [(0, *cuts, len(weights))])
        assert got[0] == 0 and got[-1] == len(weights) and all(a < b for a, b in zip(got, got[1:]))
        assert max(sum(weights[a:b]) for a, b in zip(got, got[1:])) == best
    with pytest.raises(ValueError, match="cannot split 2 layers into 3"):
        partition_balanced([1, 1], 3)


def test_pipeline_module_builds_only_its_layers_under_global_names():
    built = []

    class Probe(nn.Linear):
        def __init__(self, i):
            built.append(i)
            super().__init__(4, 4)

    layers = [LayerSpec(Probe, i) for i in range(4)] + [torch.relu]
    m = PipelineModule(layers, loss_fn=None, num_stages=2, partition_method="uniform", stage_id=1)
    assert m.parts == [0, 3, 5] and built == [3]
    assert [n for n, _ in m.named_parameters()] == ["layers.3.weight", "layers.3.bias"]
    x = torch.randn(2, 4)
    assert torch.equal(m(x), torch.relu(m.layers[3](x)))
    with pytest.raises(ValueError, match="partition_method"):
        PipelineModule(layers, num_stages=2, partition_method="type:Linear", stage_id=0)


def test_activation_checkpoint_interval_keeps_values_and_gradients():
    from zeal.deepspeed.pipe import LayerSpec as DsLayerSpec

    def build(every):
        layers = [DsLayerSpec(nn.Linear, 6, 6), torch.tanh, DsLayerSpec(nn.Linear, 6, 6), nn.GELU(),
                  DsLayerSpec(nn.Linear, 6, 2)]
        return PipelineModule(layers, num_stages=1, stage_id=0, seed_layers=True, activation_checkpoint_interval=every)

    x = torch.randn(3, 6)
    plain, ckpt = build(0), build(2)
    a, b = plain(x).square().sum(), ckpt(x).square().sum()
    a.backward()
    b.backward()
    assert torch.equal(a, b)
    for p, q in zip(plain.parameters(), ckpt.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-7)
