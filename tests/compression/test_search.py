"""NxMiFormer's configuration search: the ratio formula, DP vs exhaustive, sensitivity."""

import random

import pytest
import torch
from torch import nn

from zeal.compression.search import Choice, compression_ratio, exhaustive_search, layer_sensitivity, search

OPTIONS = [Choice(), Choice(1, 1, 8), Choice(1, 1, 4), Choice(2, 4, 32), Choice(2, 4, 8), Choice(2, 4, 4),
           Choice(1, 4, 8)]


def test_compression_ratio_examples():
    assert compression_ratio([100], [Choice(2, 4, 8)]) == 0.875
    assert compression_ratio([100], [Choice(1, 1, 4)]) == 0.875
    assert compression_ratio([100], [Choice(2, 4, 4)]) == 0.9375
    assert compression_ratio([100, 300], [Choice(), Choice(2, 4, 8)]) == pytest.approx(1 - (100 + 300 / 8) / 400)


@pytest.mark.parametrize("seed", range(6))
def test_dp_equals_exhaustive_search(seed):
    rng = random.Random(seed)
    layers = rng.randint(2, 5)
    sizes = [rng.choice([64, 128, 256, 96]) for _ in range(layers)]
    options = [rng.sample(OPTIONS, rng.randint(2, 5)) for _ in range(layers)]
    loss = [[rng.random() * (1 + (32 - c.bits) / 8 + (c.m - c.n)) for c in opts] for opts in options]
    for ratio in (0.5, 0.8, 0.875, 0.9):
        try:
            want = exhaustive_search(sizes, options, loss, ratio)
        except ValueError:
            with pytest.raises(ValueError, match="no configuration"):
                search(sizes, options, loss, ratio)
            continue
        got = search(sizes, options, loss, ratio)
        assert got[1] == pytest.approx(want[1], abs=1e-12)
        assert compression_ratio(sizes, got[0]) >= ratio - 1e-12


def test_layer_sensitivity_is_the_loss_increase_of_one_layer_alone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    x, y = torch.randn(32, 8), torch.randn(32, 4)

    def loss_fn(m):
        return float((m(x) - y).pow(2).mean())

    before = [p.clone() for p in model.parameters()]
    table = layer_sensitivity(model, {"0": model[0], "2": model[2]}, [Choice(), Choice(2, 4, 32)], loss_fn)
    assert table[0][0] == 0.0 and table[1][0] == 0.0  # uncompressed: no change
    assert table[0][1] > 0 and table[1][1] > 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # weights restored
