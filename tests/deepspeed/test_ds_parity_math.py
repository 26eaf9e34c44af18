"""What makes zeal's losses DeepSpeed's: the learning rate each update sees, the Adam
that DeepSpeed's "Adam" is, gradient clipping, and the batches of ``training_data=``.

References are DeepSpeed 0.19's documented definitions, written here from its protocol:
a schedule holds ``last_batch_iteration`` (-1 at construction, when it sets the optimizer
to its starting lr), and the engine calls ``step()`` after each applied optimizer step,
which increments it and sets the lr for the next update from it."""

from __future__ import annotations

import math

import pytest
import torch

import zeal
from zeal.config.ds_compat import translate
from zeal.train.lr_schedules import build_scheduler

pytestmark = pytest.mark.timeout(120)


def _ds_warmup_gamma(it: int, w: int, kind: str) -> float:
    w = max(2, w)
    if it >= w:
        return 1.0
    return math.log(it + 1) / math.log(w) if kind == "log" else it / w


def ds_lrs(kind: str, params: dict, base: float, n: int) -> list[float]:
    """The lr of updates 0..n-1 under DeepSpeed's schedule ``kind``."""
    out = []
    for it in range(-1, n - 1):  # the update after `it + 1` steps sees the schedule at index `it`
        w = params.get("warmup_num_steps", 1000)
        wt = params.get("warmup_type", "log")
        if kind == "WarmupLR":
            lo, hi = params.get("warmup_min_lr", 0.0), params.get("warmup_max_lr", base)
            out.append(lo if it < 0 else lo + (hi - lo) * _ds_warmup_gamma(it, w, wt))
        elif kind == "WarmupDecayLR":
            lo, hi, total = params.get("warmup_min_lr", 0.0), params.get("warmup_max_lr", 0.001), params["total_num_steps"]
            if it < 0:
                out.append(lo)
            elif it < max(2, w):
                out.append(lo + (hi - lo) * _ds_warmup_gamma(it, w, wt))
            else:
                out.append(lo + (hi - lo) * max(0.0, (total - it) / max(1.0, total - max(2, w))))
        elif kind == "WarmupCosineLR":
            total, lo = params["total_num_steps"], params.get("warmup_min_ratio", 0.0)
            cmin, ww = params.get("cos_min_ratio", 1e-4), max(2, w)
            if it < 0:
                ratio = 0.0
            elif it < ww:
                ratio = lo + (1 - lo) * _ds_warmup_gamma(it, w, wt)
            else:
                progress = min(1.0, (it - ww + 1) / max(1, total - ww))
                ratio = max(0.0, cmin + (1 - cmin) * (1 + math.cos(math.pi * progress)) / 2)
            out.append(base * ratio)
    return out


def zeal_lrs(kind: str, params: dict, base: float, n: int, opt_cls=torch.optim.AdamW) -> list[float]:
    opt = opt_cls([torch.nn.Parameter(torch.zeros(2))], lr=base)
    sched = build_scheduler(kind, dict(params), opt)
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        sched.step()
    return out


@pytest.mark.parametrize("kind,params", [
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10}),
    ("WarmupLR", {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3, "warmup_num_steps": 6, "warmup_type": "linear"}),
    ("WarmupLR", {"warmup_num_steps": 1}),  # a 1-step warm-up is DeepSpeed's 2; max = the optimizer's lr
    ("WarmupDecayLR", {"total_num_steps": 20, "warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3, "warmup_num_steps": 5}),
    ("WarmupDecayLR", {"total_num_steps": 12, "warmup_num_steps": 4, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 5, "warmup_min_ratio": 0.1}),
    ("WarmupCosineLR", {"total_num_steps": 10, "warmup_num_steps": 3, "warmup_type": "linear", "cos_min_ratio": 0.2}),
])
def test_schedules_give_each_update_deepspeeds_lr(kind, params):
    """Old zeal applied each schedule one step early: the second update already had a
    nonzero warm-up lr (the cifar example's losses drifted from step 2)."""
    assert zeal_lrs(kind, params, 5e-3, 26) == pytest.approx(ds_lrs(kind, params, 5e-3, 26), rel=1e-12, abs=1e-15)


def test_warmup_lr_first_two_updates_at_min():
    lrs = zeal_lrs("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 1000}, 1e-3, 3)
    assert lrs[:2] == [0.0, 0.0] and lrs[2] == pytest.approx(1e-3 * math.log(2) / math.log(1000))


def test_one_cycle_as_deepspeed():
    """DeepSpeed's OneCycle starts Adam at (cycle_min_mom, 0.99), keeps beta2 at 0.99,
    reaches the top at index first-1 and decays from the index after the cycle; SGD's
    momentum is not cycled (it has no betas)."""
    p = {"cycle_min_lr": 0.01, "cycle_max_lr": 0.11, "cycle_first_step_size": 4, "decay_lr_rate": 0.5,
         "decay_step_size": 2, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9}
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0, betas=(0.5, 0.999))
    sched = build_scheduler("OneCycle", p, opt)
    seen = []
    for _ in range(11):
        seen.append((opt.param_groups[0]["lr"], *opt.param_groups[0]["betas"]))
        sched.step()
    want_lr = [0.01, 0.035, 0.06, 0.085, 0.11, 0.085, 0.06, 0.035, 0.01, 0.01 / 1.25, 0.01 / 1.5]
    want_mom = [0.8, 0.875, 0.85, 0.825, 0.8, 0.825, 0.85, 0.875, 0.9, 0.9, 0.9]
    assert [s[0] for s in seen] == pytest.approx(want_lr)
    assert [s[1] for s in seen] == pytest.approx(want_mom)
    assert all(s[2] == 0.99 for s in seen)
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0, momentum=0.5)
    build_scheduler("OneCycle", p, sgd).step()
    assert sgd.param_groups[0]["momentum"] == 0.5


@pytest.mark.parametrize("ds_type,params,want_type,want_wd", [
    ("Adam", {"lr": 1e-3}, "AdamW", 0.0),  # DeepSpeed: adam_w_mode defaults to true, FusedAdam's decay to 0
    ("Adam", {"lr": 1e-3, "adam_w_mode": False, "weight_decay": 0.1}, "Adam", 0.1),
    ("AdamW", {"lr": 1e-3}, "AdamW", 0.0),
    ("Adam", {"lr": 1e-3, "torch_adam": True}, "AdamW", None),  # torch's own default then
])
def test_deepspeed_adam_maps_to_its_update(ds_type, params, want_type, want_wd):
    cfg, _ = translate({"optimizer": {"type": ds_type, "params": dict(params)}})
    assert cfg["optimizer"]["type"] == want_type
    assert cfg["optimizer"]["params"].get("weight_decay") == want_wd


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def test_adam_step_is_fusedadams_adamw_update():
    """One update of DeepSpeed's "Adam" (no weight_decay given): FusedAdam in AdamW mode
    with decay 0, ``p -= lr · m̂ / (√v̂ + eps)``; torch's AdamW default (0.01) would differ."""
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    ref = _net()
    torch.nn.functional.mse_loss(ref(x), y).backward()
    want = {n: p - 0.1 * p.grad / (p.grad.abs() + 1e-8) for n, p in ref.named_parameters()}  # t=1: m̂/√v̂ = sign
    eng = zeal.initialize(_net(), {"train_micro_batch_size_per_gpu": 16,
                                   "optimizer": {"type": "Adam", "params": {"lr": 0.1}}})
    eng.backward(torch.nn.functional.mse_loss(eng(x), y))
    eng.step()
    for n, p in eng.module.named_parameters():
        torch.testing.assert_close(p.detach(), want[n].detach(), rtol=1e-6, atol=1e-7)


def test_clipping_is_max_norm_over_norm_plus_1e_6():
    x, y = torch.randn(16, 4) * 10, torch.randn(16, 2)
    ref = _net()
    torch.nn.functional.mse_loss(ref(x), y).backward()
    norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in ref.parameters()))
    coef = min(1.0, 0.5 / (norm + 1e-6))
    assert coef < 1.0
    eng = zeal.initialize(_net(), {"train_micro_batch_size_per_gpu": 16, "gradient_clipping": 0.5,
                                   "optimizer": {"type": "SGD", "params": {"lr": 1.0}}})
    eng.backward(torch.nn.functional.mse_loss(eng(x), y))
    eng.step()
    assert eng.grad_norm == pytest.approx(norm, rel=1e-6)
    for (_, p), q in zip(eng.module.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), (q - coef * q.grad).detach(), rtol=1e-6, atol=1e-7)


class _Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 21

    def __getitem__(self, i: int):
        return torch.full((4,), float(i)), torch.zeros(2)


@pytest.mark.parametrize("drop_last", [False, True])
def test_training_data_draws_distributed_samplers_batches(drop_last):
    """DeepSpeed's loader: ``DistributedSampler(dataset)`` (seed 0, shuffled, padded),
    batches of the micro-batch size, ``dataloader_drop_last``; the same order each pass."""
    data = _Rows()
    eng = zeal.initialize(_net(), {"train_micro_batch_size_per_gpu": 4, "dataloader_drop_last": drop_last},
                          training_data=data)
    ref = torch.utils.data.DataLoader(data, batch_size=4, drop_last=drop_last,
                                      sampler=torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0))
    want = [x[:, 0].tolist() for x, _ in ref]
    for _ in range(2):
        assert [x[:, 0].tolist() for x, _ in eng.dataloader] == want
    assert len(want[-1]) == (4 if drop_last else 1)
    eng.dataloader.data_sampler.set_epoch(1)
    ref.sampler.set_epoch(1)
    assert [x[:, 0].tolist() for x, _ in eng.dataloader] == [x[:, 0].tolist() for x, _ in ref]


def test_training_data_seed_from_config():
    data = _Rows()
    eng = zeal.initialize(_net(), {"train_micro_batch_size_per_gpu": 4, "seed": 9}, training_data=data)
    ref = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, seed=9)
    assert [int(v) for x, _ in eng.dataloader for v in x[:, 0]] == list(ref)
