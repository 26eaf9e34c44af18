"""A parameter that gets no gradient in a step is not moved by an old gradient."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.dist_harness import run_ranks


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 6)
        self.a = nn.Linear(6, 1)
        self.b = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor, use_a: bool) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        return ((self.a if use_a else self.b)(h) ** 2).mean()


def _run(rank, world):
    import zeal

    out = {}
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        engine = zeal.initialize(TwoHeads(), {
            "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 1.0}},  # a step moves a parameter by its gradient
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
        x = torch.randn(2, 6, generator=torch.Generator().manual_seed(rank))
        for use_a in (True, False):  # step 1 trains head a, step 2 head b only
            before = {k: v.clone() for k, v in engine.module_state_dict().items()}
            for _ in range(2):
                engine.backward(engine((x, use_a)))
                engine.step()
        after = engine.module_state_dict()
        out[stage] = {k: bool((torch.as_tensor(after[k]) == torch.as_tensor(before[k])).all())
                      for k in ("a.weight", "a.bias", "b.weight")}
    return out


@pytest.mark.timeout(120)
def test_unused_head_is_not_moved_by_a_stale_gradient():
    for res in run_ranks(_run, 2, timeout=100):
        for stage, unchanged in res.items():
            # head a got no gradient in step 2: it must not move; head b did move
            assert unchanged == {"a.weight": True, "a.bias": True, "b.weight": False}, (stage, unchanged)
