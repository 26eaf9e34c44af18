"""``deepspeed.utils.safe_get_full_* / safe_set_full_*`` and the ``local`` variants on zeal,
on 2 gloo ranks (ZeRO 3 and 1) and 1 rank, against one process of plain torch AdamW on
the same model and the same (concatenated) batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.dist_harness import RankPool

pytestmark = pytest.mark.timeout(300)

_POOLS: dict[int, RankPool] = {}


@pytest.fixture(scope="module")
def pool():
    yield lambda world: _POOLS.setdefault(world, RankPool(world))
    for p in _POOLS.values():
        p.close()
    _POOLS.clear()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(2, 6, generator=g), torch.randn(2, 3, generator=g)


def _reference(world: int) -> dict:
    """Plain torch: the mean loss over every rank's batch, one AdamW step."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    xs, ys = zip(*(_batch(r) for r in range(world)))
    loss = nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys))
    loss.backward()
    grads = {n: q.grad.clone() for n, q in model.named_parameters()}
    opt.step()
    return {"grad": grads, "fp32": {n: q.detach().clone() for n, q in model.named_parameters()},
            "exp_avg": {n: opt.state[q]["exp_avg"].clone() for n, q in model.named_parameters()},
            "exp_avg_sq": {n: opt.state[q]["exp_avg_sq"].clone() for n, q in model.named_parameters()}}


def _rank(rank: int, world: int, stage: int) -> dict:
    import zeal.deepspeed as deepspeed
    from zeal.deepspeed.refusals import Refused
    from zeal.deepspeed.utils import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
        safe_get_local_fp32_param,
        safe_get_local_optimizer_state,
        safe_set_full_fp32_param,
        safe_set_full_grad,
        safe_set_full_optimizer_state,
        safe_set_local_fp32_param,
    )

    torch.manual_seed(0)
    model = Net()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
           "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    named = dict(engine.module.named_parameters())
    x, y = _batch(rank)
    loss = nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    out: dict = {"before_step": {n: safe_get_full_optimizer_state(q, "exp_avg") for n, q in named.items()}}
    out["grad"] = {n: safe_get_full_grad(q) for n, q in named.items()}
    engine.step()
    out["fp32"] = {n: safe_get_full_fp32_param(q) for n, q in named.items()}
    out["exp_avg"] = {n: safe_get_full_optimizer_state(q, "exp_avg") for n, q in named.items()}
    out["exp_avg_sq"] = {n: safe_get_full_optimizer_state(q, "exp_avg_sq") for n, q in named.items()}
    out["local_fp32"] = {n: safe_get_local_fp32_param(q) for n, q in named.items()}
    out["local_exp_avg"] = {n: safe_get_local_optimizer_state(q, "exp_avg") for n, q in named.items()}

    # writes: the master, the model copy and the moments take the new values everywhere
    w = named["fc1.weight"]
    new = torch.arange(48, dtype=torch.float32).view(8, 6) / 100
    safe_set_full_fp32_param(w, new)
    out["set_fp32"] = safe_get_full_fp32_param(w)
    with deepspeed.zero.GatheredParameters([w]):
        out["set_model"] = w.detach().clone()
    safe_set_full_optimizer_state(named["fc2.bias"], torch.full((3,), 0.25), "exp_avg")
    out["set_exp_avg"] = safe_get_full_optimizer_state(named["fc2.bias"], "exp_avg")
    local = safe_get_local_fp32_param(named["fc2.weight"])
    safe_set_local_fp32_param(named["fc2.weight"], local + 1.0)
    out["set_local"] = safe_get_full_fp32_param(named["fc2.weight"])
    try:
        safe_set_full_grad(w, new)
    except Refused as e:
        out["refused"] = str(e)
    try:
        safe_get_full_fp32_param(nn.Parameter(torch.zeros(2)))
    except ValueError as e:
        out["foreign"] = str(e)
    engine.destroy()
    return out


# fp32, the same math in another summation order: a few float32 ulps
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _tensors(obj):
    """The harness hands back numpy arrays: tensors again."""
    if isinstance(obj, dict):
        return {k: _tensors(v) for k, v in obj.items()}
    return obj if obj is None or isinstance(obj, str) else torch.as_tensor(obj)


def _check(results: list[dict], world: int) -> None:
    ref = _reference(world)
    results = [_tensors(r) for r in results]
    for r in results:
        assert all(v is None for v in r["before_step"].values())  # no state before the first step
        for what in ("grad", "fp32", "exp_avg", "exp_avg_sq"):
            for name, want in ref[what].items():
                torch.testing.assert_close(r[what][name], want, **TOL, msg=f"{what} {name}")
        assert torch.equal(r["set_fp32"], torch.arange(48, dtype=torch.float32).view(8, 6) / 100)
        assert torch.equal(r["set_model"], r["set_fp32"])
        assert torch.equal(r["set_exp_avg"], torch.full((3,), 0.25))
        torch.testing.assert_close(r["set_local"], ref["fp32"]["fc2.weight"] + 1.0, **TOL)
        assert "safe_set_full_grad" in r["refused"] and "backward" in r["refused"]
        assert "deepspeed.initialize" in r["foreign"]
    # the local parts, in rank order, are the flattened parameter (zeal's flat partition)
    for name, want in ref["fp32"].items():
        torch.testing.assert_close(torch.cat([r["local_fp32"][name] for r in results]), want.reshape(-1), **TOL)
        torch.testing.assert_close(torch.cat([r["local_exp_avg"][name] for r in results]),
                                   ref["exp_avg"][name].reshape(-1), **TOL)


@pytest.mark.parametrize("stage", [3, 1])
def test_safe_get_full_two_ranks(pool, stage):
    _check(pool(2).run(_rank, stage, timeout=240), 2)


def test_safe_get_full_one_rank(pool):
    _check(pool(1).run(_rank, 0, timeout=240), 1)
