"""N:M sparsity inside the engine: masked weights exactly zero after every AdamW step with
weight decay (stages 0-3), moments of pruned weights zero, density exactly N/M, and the
same masks on 2 gloo ranks (where a partition boundary cuts a group of l1) as on 1."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.dist_harness import run_ranks
from zeal.compression.nm import group_density

TARGETS = ("l1.weight", "l2.weight")


class Net(nn.Module):
    """l1's unit has 8·12 + 12 = 108 elements: on 2 ranks its shard boundary (54) cuts a
    group of 4; l2's (104, boundary 52) does not."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 12)
        self.l2 = nn.Linear(12, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.head(torch.tanh(self.l2(torch.tanh(self.l1(x))))) - y).pow(2).mean()


def _config(stage: int, method: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "compression": {"sparsity": {"enabled": True, "pattern": "2:4", "method": method, "modules": ["l1", "l2"],
                                     "prune_step": 3 if method == "admm" else 0, "admm_interval": 1,
                                     "rho": 0.05, "rho_growth": 1.5, "rho_max": 1.0, "admm_penalty": "grad"}},
    }


def _run(rank: int, world: int, stages: list[int], method: str) -> dict:
    import zeal

    out = {}
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)) for _ in range(6)]
    for stage in stages:
        torch.manual_seed(0)
        engine = zeal.initialize(Net(), _config(stage, method))
        hook = next(h for h in engine._hooks if type(h).__name__ == "SparsityHook")
        zeros_kept, weights = [], None
        for step, (x, y) in enumerate(batches):  # every rank the same batch: the 1-rank trajectory
            engine.backward(engine(x, y))
            engine.step()
            sd = engine.module_state_dict()
            if step >= 3 or method == "magnitude":
                zeros_kept.append(all(bool((group_density(sd[n] != 0, 4) <= 2).all()) for n in TARGETS))
            weights = {n: sd[n].clone() for n in TARGETS}
        moments_zero = True
        with engine.sharded_state() as st:
            for sh in st.shards:
                if sh.name in TARGETS:
                    dead = sh.master == 0
                    moments_zero &= all(bool((v[dead] == 0).all()) for v in sh.moments.values())
        out[stage] = {"weights": weights, "zeros_kept": zeros_kept, "moments_zero": moments_zero,
                      "residuals": [(r.primal, r.dual) for r in hook.history],
                      "local": sorted(e.local for e in hook.sparse.entries.values())}
        engine.close()
    return out


def _check(res: dict, method: str) -> None:
    for stage, r in res.items():
        assert all(r["zeros_kept"]) and r["zeros_kept"], stage
        assert r["moments_zero"], stage
        for n in TARGETS:
            w = torch.as_tensor(r["weights"][n])
            assert bool((group_density(w != 0, 4) == 2).all()), (stage, n)  # exactly 2 of 4 survive
        if method == "admm":
            assert len(r["residuals"]) == 3


@pytest.mark.timeout(120)
def test_masked_weights_stay_zero_single_rank():
    for method in ("magnitude", "admm"):
        res = _run(0, 1, [0, 3], method)
        _check(res, method)
        assert torch.equal(torch.as_tensor(res[0]["weights"]["l1.weight"]) != 0,
                           torch.as_tensor(res[3]["weights"]["l1.weight"]) != 0)


@pytest.mark.timeout(240)
def test_same_masks_under_zero3_on_two_ranks():
    one = _run(0, 1, [3], "admm")
    two = run_ranks(_run, 2, [0, 1, 2, 3], "admm", timeout=200)
    for rank in range(2):
        _check(two[rank], "admm")
        for stage in (0, 1, 2, 3):
            for n in TARGETS:
                a, b = torch.as_tensor(two[rank][stage]["weights"][n]), torch.as_tensor(one[3]["weights"][n])
                assert torch.equal(a != 0, b != 0), (rank, stage, n)
                assert torch.allclose(a, b, atol=1e-5), (rank, stage, n)
    assert two[0][3]["local"] == [False, True]  # l1 takes the gather path, l2 stays local
    p1, p2 = one[3]["residuals"], two[0][3]["residuals"]
    assert all(abs(a[0] - b[0]) <= 1e-5 * (1 + a[0]) for a, b in zip(p1, p2))  # residuals summed over shards


@pytest.mark.timeout(120)
def test_qat_and_masks_in_the_engine_match_plain_pytorch():
    import zeal
    from zeal.compression.hooks import MaskEnforcer
    from zeal.compression.modules import QuantSpec, linear_targets, magnitude_masks, swap_qat

    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)) for _ in range(4)]
    cfg = _config(3, "magnitude")
    cfg["compression"]["quantization"] = {"enabled": True, "bits": 4, "group_size": 4, "modules": ["l1", "l2"]}
    torch.manual_seed(0)
    engine = zeal.initialize(Net(), cfg)
    torch.manual_seed(0)
    ref = Net()
    targets = linear_targets(ref, ["l1", "l2"])
    masks = magnitude_masks(targets, 2, 4)
    swap_qat(ref, targets, QuantSpec(4, 4))
    opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1)
    params = dict(ref.named_parameters())
    MaskEnforcer(opt, [params[n] for n in masks], list(masks.values()))
    for x, y in batches:
        engine.backward(engine(x, y))
        engine.step()
        opt.zero_grad()
        ref(x, y).backward()
        opt.step()
    got = engine.module_state_dict()
    for n, p in ref.named_parameters():
        assert torch.allclose(got[n], p.detach(), atol=1e-5), n
    engine.close()


@pytest.mark.timeout(120)
def test_masks_follow_a_checkpoint_loaded_after_initialize(tmp_path):
    import zeal

    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)) for _ in range(3)]
    torch.manual_seed(0)
    first = zeal.initialize(Net(), _config(0, "magnitude"))
    for x, y in batches[:2]:
        first.backward(first(x, y))
        first.step()
    first.save_checkpoint(str(tmp_path))
    support = {n: first.module_state_dict()[n] != 0 for n in TARGETS}
    torch.manual_seed(5)  # another init: its own masks at initialize
    second = zeal.initialize(Net(), _config(0, "magnitude"))
    assert any(not torch.equal(second.module_state_dict()[n] != 0, support[n]) for n in TARGETS)
    second.load_checkpoint(str(tmp_path))
    x, y = batches[2]
    second.backward(second(x, y))
    second.step()
    for n in TARGETS:
        assert torch.equal(second.module_state_dict()[n] != 0, support[n]), n
    first.close()
    second.close()


@pytest.mark.timeout(120)
def test_admm_in_the_engine_matches_plain_pytorch():
    """The penalty gradient on the master shards, Z/U on the shards, pruning at step 3,
    masked AdamW after: the same weights as ADMM over the whole tensors."""
    import zeal
    from zeal.compression.admm import ADMM, RhoSchedule
    from zeal.compression.hooks import MaskEnforcer
    from zeal.compression.nm import nm_mask, nm_project

    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)) for _ in range(5)]
    torch.manual_seed(0)
    ref = Net()
    params = dict(ref.named_parameters())
    opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1)
    admm = ADMM({n: params[n] for n in TARGETS}, lambda _k, v: nm_project(v.view(params[_k].shape), 2, 4),
                RhoSchedule(0.05, 1.5, 1.0))
    for step, (x, y) in enumerate(batches):
        opt.zero_grad()
        ref(x, y).backward()
        if step < 3:
            admm.add_penalty_grad_()
        opt.step()
        if step < 3:
            admm.update()
        if step == 2:
            MaskEnforcer(opt, [params[n] for n in TARGETS], [nm_mask(params[n].detach().abs(), 2, 4) for n in TARGETS])
    for stage in (0, 3):
        torch.manual_seed(0)
        engine = zeal.initialize(Net(), _config(stage, "admm"))
        for x, y in batches:
            engine.backward(engine(x, y))
            engine.step()
        got = engine.module_state_dict()
        for n, p in ref.named_parameters():
            assert torch.allclose(got[n], p.detach(), atol=1e-5), (stage, n)
        engine.close()
