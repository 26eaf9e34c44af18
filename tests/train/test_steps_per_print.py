"""``steps_per_print`` in a DeepSpeed config prints DeepSpeed's two progress lines on
rank 0 (``[Rank 0] step=…, skipped=…, lr=[…], mom=[…]`` and ``steps: … loss: …``); a
config that does not set it prints nothing."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import zeal

pytestmark = pytest.mark.timeout(60)


def _train(config: dict, steps: int) -> list[float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    engine = zeal.initialize(model, config)
    losses = []
    for i in range(steps):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(i))
        loss = engine(x).pow(2).mean()
        losses.append(float(loss.detach()))
        engine.backward(loss)
        engine.step()
    return losses


def _config(**extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **extra}


def test_steps_per_print_prints_deepspeeds_step_and_loss_lines(capsys):
    losses = _train(_config(steps_per_print=2), 5)
    out = capsys.readouterr().out.splitlines()
    steps = [line for line in out if line.startswith("[Rank 0] step=")]
    assert [int(re.match(r"\[Rank 0\] step=(\d+),", s).group(1)) for s in steps] == [2, 4]
    assert re.fullmatch(r"\[Rank 0\] step=2, skipped=0, lr=\[0\.001\], mom=\[\(0\.9, 0\.999\)\]", steps[0]), steps[0]
    loss_lines = [line for line in out if line.startswith("steps: ")]
    assert len(loss_lines) == 2
    m = re.fullmatch(r"steps: 4 loss: (\S+) iter time \(s\): \S+ samples/sec: \S+", loss_lines[1])
    assert m and float(m.group(1)) == pytest.approx(losses[3], abs=1e-4)  # the 4th step's loss


def test_no_steps_per_print_no_lines(capsys):
    _train(_config(), 12)
    assert capsys.readouterr().out == ""
