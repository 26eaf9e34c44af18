"""Checkpoints of expert-parallel runs: saved at EP 2 (2 gloo ranks, ZeRO 1), resumed at
EP 2 bit-exactly, and loaded at EP 1 × DP 2 (stage 2), EP 4 (stage 2), EP 2 × DP 2
(stage 1) and in one process (EP 1, stage 0).

Oracles: the uninterrupted EP 2 run's losses (exact at the same layout; to fp32
rounding at another one, whose global batch is the same: drop_tokens=False makes the
model independent of the expert split); and the state itself: every resharded load
saves again, and both checkpoints, assembled into full tensors (masters, Adam moments,
step), are ``torch.equal`` (a box written twice or missing fails the assembly). The
HF-folder export of the EP 2 checkpoint holds every expert, equal to the single-process
model's state after the load.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.checkpoint.test_resume_reshard import _same, assemble
from tests.dist_harness import run_ranks
from tests.moe.models import EXPERTS, TinyMoENet, batches

STEPS, SAVED_AT, LR, CLIP, BATCH = 5, 2, 1e-2, 0.5, 4


def _config(stage: int, world: int) -> dict:
    return {"train_micro_batch_size_per_gpu": BATCH // world, "gradient_clipping": CLIP,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 200},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "fused": False}}}


def _train(engine, rank: int, world: int, steps: range) -> list[float]:
    data = batches(STEPS, world, micro=BATCH // world)
    losses = []
    for s in steps:
        loss = engine(*data[s][rank])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def _engine(ep: int, stage: int, world: int, seed: int):
    import zeal

    torch.manual_seed(seed)  # a different init each time: everything must come from the checkpoint
    model = TinyMoENet(ep_size=ep)
    for n, p in model.named_parameters():
        if n.endswith(".2.bias"):  # a frozen expert tensor: outside ZeRO's units, held by its ep rank only
            p.requires_grad_(False)
    return zeal.initialize(model, _config(stage, world))


def _two_ranks(rank: int, world: int, root: str) -> dict:
    engine = _engine(2, 1, world, 0)
    _train(engine, rank, world, range(SAVED_AT))
    engine.save_checkpoint(root, tag="ep2")
    experts = sorted({n.split(".")[4] for n, _ in engine.module.named_parameters() if ".experts." in n})
    out = {"straight": _train(engine, rank, world, range(SAVED_AT, STEPS)), "experts": experts}
    engine = _engine(2, 1, world, 1)
    engine.load_checkpoint(root, tag="ep2")
    out["resume"] = _train(engine, rank, world, range(SAVED_AT, STEPS))
    engine = _engine(1, 2, world, 2)  # every expert on both ranks, stage 2
    engine.load_checkpoint(root, tag="ep2")
    engine.save_checkpoint(root, tag="ep2_to_ep1dp2")
    out["ep1dp2"] = _train(engine, rank, world, range(SAVED_AT, STEPS))
    return out


def _four_ranks(rank: int, world: int, root: str) -> dict:
    out = {}
    for ep, stage in ((4, 2), (2, 1)):  # EP 4; EP 2 x expert-data 2
        engine = _engine(ep, stage, world, 3)
        engine.load_checkpoint(root, tag="ep2")
        engine.save_checkpoint(root, tag=f"ep2_to_ep{ep}s{stage}")
        out[ep] = _train(engine, rank, world, range(SAVED_AT, STEPS))
    return out


def _mean(per_rank: list[list[float]]) -> list[float]:
    return [sum(x) / len(per_rank) for x in zip(*per_rank)]


@pytest.mark.timeout(150)
def test_expert_parallel_checkpoint_resume_and_reshard(tmp_path):
    from zeal.checkpoint.export import export_hf

    root = str(tmp_path)
    two = run_ranks(_two_ranks, 2, root, timeout=100)
    assert [r["experts"] for r in two] == [["0", "1"], ["2", "3"]]  # saved by each rank: its own experts
    straight = _mean([r["straight"] for r in two])
    for r in two:
        assert r["resume"] == r["straight"]  # same layout: exact
        assert r["ep1dp2"] == pytest.approx(r["straight"], rel=1e-5, abs=1e-6)
    full = assemble(tmp_path / "ep2")
    assert {k for k in full if k.startswith("param/") and ".experts." in k} == {
        f"param/moe.deepspeed_moe.experts.deepspeed_experts.{g}.{i}.{w}"
        for g in range(EXPERTS) for i in (0, 2) for w in ("weight", "bias")}
    _same(full, assemble(tmp_path / "ep2_to_ep1dp2"), "EP 2 -> EP 1 x DP 2, stage 1 -> 2")

    four = run_ranks(_four_ranks, 4, root, timeout=100)
    for ep, stage in ((4, 2), (2, 1)):
        _same(full, assemble(tmp_path / f"ep2_to_ep{ep}s{stage}"), f"EP 2 -> EP {ep} on 4 ranks, stage {stage}")
        assert _mean([r[ep] for r in four]) == pytest.approx(straight, rel=1e-5, abs=1e-6), ep

    # one process, every expert local: saved by 4 ranks (EP 2 x expert-data 2) and by 2 (EP 2)
    for tag in ("ep2_to_ep2s1", "ep2"):
        engine = _engine(1, 0, 1, 4)
        engine.load_checkpoint(root, tag=tag)
        state = engine.module_state_dict()
        engine.save_checkpoint(root, tag=f"{tag}_to_ep1")
        _same(full, assemble(tmp_path / f"{tag}_to_ep1"), f"{tag} -> one process")
        assert _train(engine, 0, 1, range(SAVED_AT, STEPS)) == pytest.approx(straight, rel=1e-5, abs=1e-6), tag

    export_hf(tmp_path / "ep2", tmp_path / "hf")  # every expert, from both ranks' files
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert exported.keys() == state.keys()
    for k, v in exported.items():
        assert torch.equal(v, state[k]), k
        assert torch.equal(v, full[f"param/{k}"]), k
    assert np.isfinite(straight).all()
