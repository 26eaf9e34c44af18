"""ADMM with the proximal penalty in the engine (``compression.sparsity.admm_penalty: prox``):
ZeRO-3 on 2 gloo ranks (l1's shard boundary cuts a group: the gather path; l2 stays local)
gives the same masks and weights as plain PyTorch in one process, the primal residual
falls, masked weights stay exactly zero after every step; and the config keys."""

from __future__ import annotations

import pytest
import torch

from tests.compression.test_engine_sparsity import TARGETS, Net
from tests.dist_harness import run_ranks
from zeal.config import ConfigError, load_config

PRUNE, STEPS = 4, 6
SPARSITY = {"enabled": True, "pattern": "2:4", "method": "admm", "modules": ["l1", "l2"], "prune_step": PRUNE,
            "admm_interval": 1, "rho": 0.2, "rho_max": 2.0}


def _batches() -> list:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)) for _ in range(STEPS)]


def _engine_run(rank: int, world: int, stage: int) -> dict:
    import zeal
    from zeal.compression.nm import group_density

    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.1}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
           "compression": {"sparsity": SPARSITY}}
    torch.manual_seed(0)
    engine = zeal.initialize(Net(), cfg)
    hook = next(h for h in engine._hooks if type(h).__name__ == "SparsityHook")
    kept = []
    for step, (x, y) in enumerate(_batches()):  # every rank the same batch: the 1-process trajectory
        engine.backward(engine(x, y))
        engine.step()
        sd = engine.module_state_dict()
        if step + 1 >= PRUNE:
            kept.append(all(bool((group_density(sd[n] != 0, 4) == 2).all()) for n in TARGETS))
    out = {"weights": {n: engine.module_state_dict()[n].clone() for n in TARGETS}, "kept": kept,
           "primal": [r.primal for r in hook.history], "local": sorted(e.local for e in hook.sparse.entries.values())}
    engine.close()
    return out


def _reference() -> dict:
    """Plain PyTorch: AdamW, then the prox step, then the Z/U step; pruning after step PRUNE."""
    from zeal.compression.admm import ADMM
    from zeal.compression.apply import rho_schedule
    from zeal.compression.hooks import MaskEnforcer
    from zeal.compression.nm import nm_mask, nm_project

    torch.manual_seed(0)
    ref = Net()
    params = dict(ref.named_parameters())
    opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1)
    sched = rho_schedule(load_config({"compression": {"sparsity": SPARSITY}}).compression.sparsity)
    admm = ADMM({n: params[n] for n in TARGETS}, lambda k, v: nm_project(v.view(params[k].shape), 2, 4), sched)
    primal = []
    for step, (x, y) in enumerate(_batches()):
        opt.zero_grad()
        ref(x, y).backward()
        opt.step()
        if step < PRUNE:
            admm.prox_()
            primal.append(admm.update().primal)
        if step + 1 == PRUNE:
            MaskEnforcer(opt, [params[n] for n in TARGETS], [nm_mask(params[n].detach().abs(), 2, 4) for n in TARGETS])
    return {"weights": {n: params[n].detach().clone() for n in TARGETS}, "primal": primal}


@pytest.mark.timeout(120)
def test_prox_admm_under_zero3_on_two_ranks_matches_one_process():
    ref = _reference()
    assert ref["primal"][-1] < 0.5 * ref["primal"][0]  # the prox step drives W onto the N:M set
    one = _engine_run(0, 1, 0)
    two = run_ranks(_engine_run, 2, 3, timeout=100)
    assert two[0]["local"] == [False, True]  # l1 takes the gather path, l2 stays local
    for res in (one, two[0], two[1]):
        assert res["kept"] == [True] * (STEPS - PRUNE + 1)  # exactly 2 of 4 after every step from pruning on
        assert all(abs(a - b) <= 1e-4 * (1 + a) for a, b in zip(res["primal"], ref["primal"]))
        assert len(res["primal"]) == PRUNE
        for n in TARGETS:
            a, b = torch.as_tensor(res["weights"][n]), ref["weights"][n]
            assert torch.equal(a != 0, b != 0), n
            assert torch.allclose(a, b, atol=1e-5), n


def test_admm_penalty_and_metric_keys():
    sc = load_config({"compression": {"sparsity": {"enabled": True}}}).compression.sparsity
    assert (sc.admm_penalty, sc.admm_metric, sc.rho, sc.rho_max, sc.rho_growth) == ("prox", "euclidean", 0.3, 10.0, None)
    for key, bad in (("admm_penalty", "proximal"), ("admm_metric", "cosine")):
        with pytest.raises(ConfigError, match=key):
            load_config({"compression": {"sparsity": {key: bad}}})
    from zeal.compression.apply import apply_compression, rho_schedule

    sc = load_config({"compression": {"sparsity": {**SPARSITY, "prune_step": 40, "admm_interval": 10}}})
    sched = rho_schedule(sc.compression.sparsity)  # 4 Z-steps: 0.2 -> 2.0 geometrically
    assert [round(sched.at(k), 6) for k in range(5)] == [0.2, round(0.2 * 10 ** (1 / 3), 6),
                                                         round(0.2 * 10 ** (2 / 3), 6), 2.0, 2.0]
    for patch, key in (({"admm_metric": "activation"}, "admm_metric"), ({"rho": 5.0}, "rho")):
        cfg = load_config({"compression": {"sparsity": {**SPARSITY, **patch}}}).compression
        with pytest.raises(ConfigError, match=f"compression.sparsity.{key}'"):
            apply_compression(Net(), cfg)
