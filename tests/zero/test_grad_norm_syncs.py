"""The optimizer step's gradient norm and fp16 overflow check read the device once per step,
not once per tensor (S5: ``float(vector_norm(g))`` per master was one host sync each, ~150 per
step for a 1B model at stage 3). Host syncs are counted with a TorchFunctionMode that sees
every tensor → Python conversion; the values equal the per-tensor formula exactly."""

from __future__ import annotations

import math

import torch
from torch.overrides import TorchFunctionMode

from zeal.config.schema import FP16Config
from zeal.precision.loss_scaler import LossScaler
from zeal.zero.optimizer import all_finite, squared_norms, unscale_check_clip
from zeal.zero.stages import resolve_stage

SYNCS = {"__float__", "__bool__", "__int__", "item", "tolist", "__index__"}


class CountSyncs(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in SYNCS:
            self.n += 1
        return func(*args, **(kwargs or {}))


class OneRank:
    def all_reduce_scalar(self, v, op):
        return v


def _grads(n: int = 10) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(7 + i, generator=g, dtype=torch.bfloat16 if i % 3 == 0 else torch.float32) for i in range(n)]


def test_norm_and_overflow_check_take_one_sync_each():
    grads = _grads()
    ref = [float(torch.linalg.vector_norm(g, dtype=torch.float32)) ** 2 for g in grads]
    with CountSyncs() as c:
        ok, norm = unscale_check_clip([g.clone() for g in grads], OneRank(), resolve_stage(0),
                                      LossScaler(FP16Config(enabled=True, loss_scale=1.0)), clip=0.0)
    assert ok and norm == math.sqrt(sum(ref))  # same values, same summation order: bit-equal
    assert c.n == 2, c.n  # one for the overflow flags, one for the norms (was 2 per tensor)


def test_squared_norms_and_all_finite():
    grads = _grads(4)
    assert squared_norms(grads) == [float(torch.linalg.vector_norm(g, dtype=torch.float32)) ** 2 for g in grads]
    assert squared_norms([]) == [] and all_finite([]) and all_finite(grads)
    grads[2][1] = float("nan")
    assert not all_finite(grads)
