"""Per-expert LoRA adapters on an MoE model: each expert's linears get adapters of their
own (marked as expert parameters), trained through ``zeal.initialize`` with the losses and
adapter weights of plain PyTorch on the same model (the same apply-step, torch AdamW on
the whole batch) — one process at ZeRO 0, and expert parallelism 2 on 2 gloo ranks at
ZeRO 2 and 3 (each rank holding its experts' adapters); ``save_adapter`` gathers every
expert's adapter from its ep rank.

Tolerance: 1e-5 relative on losses and 1e-5 absolute on adapter weights, as in
tests/moe/test_expert_parallel.py (the ep all-to-all and the 2-rank gradient average
reorder sums by a few ulps)."""

from __future__ import annotations

import pytest
import torch

from tests.dist_harness import run_ranks
from tests.moe.models import EXPERTS, TinyMoENet, batches

STEPS, LR, SEED = 3, 1e-2, 7
TARGETS = r".*deepspeed_experts\.\d+\.(0|2)"  # both linears of every expert
LORA = {"enabled": True, "r": 2, "alpha": 4, "target_modules": TARGETS, "init": "gaussian"}


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "seed": SEED, "lora": dict(LORA),
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "fused": False}}}


def _reference(world: int) -> tuple[list[float], dict]:
    from zeal.config.lora import LoraConfig
    from zeal.lora.apply import apply_lora

    torch.manual_seed(0)
    model = TinyMoENet()
    apply_lora(model, LoraConfig(**LORA), SEED)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    losses = []
    for step in batches(STEPS, world):
        loss = model(torch.cat([m[0] for m in step]), torch.cat([m[1] for m in step]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}


def _train(rank: int, world: int, stage: int, ep: int, folder: str | None = None) -> dict:
    import zeal

    torch.manual_seed(0)
    engine = zeal.initialize(TinyMoENet(ep_size=ep), _config(stage))
    trainable = sorted(n for n, p in engine.module.named_parameters() if p.requires_grad)
    losses = []
    for step in batches(STEPS, world):
        loss = engine(*step[rank])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    with engine.gathered_parameters():
        state = {n: p.detach().clone() for n, p in engine.module.named_parameters() if ".lora_" in n}
    if folder is not None:
        engine.save_adapter(folder)
    engine.close()
    return {"losses": losses, "state": state, "trainable": trainable}


def _check(world: int, results: list[dict]) -> None:
    ref_losses, ref_state = _reference(world)
    losses = [sum(r["losses"][i] for r in results) / world for i in range(STEPS)]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for r in results:
        assert r["trainable"] and all(".lora_" in n and ".experts." in n for n in r["trainable"])
        assert r["state"]
        for n, t in r["state"].items():
            torch.testing.assert_close(torch.as_tensor(t), ref_state[n], rtol=0, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    # per expert: every expert's adapter moved, and differently
    b = [ref_state[f"moe.deepspeed_moe.experts.deepspeed_experts.{g}.0.lora_B.weight"] for g in range(EXPERTS)]
    assert all(x.abs().max() > 0 for x in b) and not torch.equal(b[0], b[1])


@pytest.mark.timeout(60)
def test_expert_adapters_one_process_equal_plain_torch(tmp_path):
    from zeal.lora.peft_folder import read_adapter

    res = _train(0, 1, 0, 1, str(tmp_path))
    _check(1, [res])
    saved = read_adapter(str(tmp_path))
    assert len(saved.lora) == 2 * EXPERTS


def _ep_runs(rank: int, world: int, folder: str) -> dict:
    return {stage: _train(rank, world, stage, 2, folder if stage == 3 else None) for stage in (2, 3)}


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_expert_adapters_ep2_two_ranks_equal_one_process(tmp_path):
    from zeal.lora.peft_folder import read_adapter

    results = run_ranks(_ep_runs, 2, str(tmp_path), timeout=140)
    for stage in (2, 3):
        per_rank = [r[stage] for r in results]
        assert {len(r["state"]) for r in per_rank} == {2 * EXPERTS // 2 * 2}  # this rank's experts' A and B
        _check(2, per_rank)
    saved = read_adapter(str(tmp_path))  # every expert's adapter, gathered over ep
    _, ref_state = _reference(2)
    assert len(saved.lora) == 2 * EXPERTS
    for m, pair in saved.lora.items():
        torch.testing.assert_close(pair.B, ref_state[f"{m}.lora_B.weight"], rtol=0, atol=1e-5)
