"""Checkpoints: bit-exact resume (stages 0–3, 2 ranks, fp32) and the reshard matrix.

Oracle for resharding: after a load at a new world size / stage, the engine saves
again; both checkpoints are assembled into full per-parameter tensors (masters,
Adam moments, step) in this process, and must be ``torch.equal``. Every spawned
run covers several cases, to keep the number of process launches low.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.dist_harness import run_ranks
from tests.train.models import TinyNet, make_batches
from zeal.checkpoint.files import read_manifest
from zeal.checkpoint.load import open_shards, read_meta

ACCUM, MICRO, LR, CLIP = 2, 2, 1e-2, 0.05
STAGES = [0, 1, 2, 3]


def config(stage: int, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": LR}},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 300,
                              "stage3_param_persistence_threshold": 50, "stage3_prefetch_bucket_size": 500},
        **extra,
    }


def train(engine, rank: int, world: int, steps: range) -> list[float]:
    batches = make_batches(steps.stop, ACCUM, world, MICRO)
    losses = []
    for s in steps:
        for micro in batches[s]:
            loss = engine(micro[rank])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def rank_state(engine) -> dict:
    """Everything a rank holds that must survive a resume (masters and optimizer state
    through the public sharded-state API)."""
    masters, opt = {}, {}
    with engine.sharded_state() as st:
        for sh in st.shards:
            key = f"{sh.name}{list(sh.box)}"
            masters[key] = sh.master.clone()
            opt.update({f"{key}/{k}": torch.as_tensor(v).clone() for k, v in {**sh.moments, **sh.scalars}.items()})
    return {"params": engine.module_state_dict(), "masters": masters,
            "opt": opt, "lr": engine.optimizer.param_groups[0]["lr"],
            "counters": [engine.global_steps, engine.micro_steps, engine.global_samples, engine.skipped_steps]}


def rng_draw() -> list:
    return [torch.rand(3).tolist(), random.random(), float(np.random.rand())]


def _straight_and_save(rank: int, world: int, root: str):
    import zeal

    out = {}
    for stage in STAGES:
        torch.manual_seed(0)
        engine = zeal.initialize(TinyNet(), config(stage))
        losses = train(engine, rank, world, range(0, 5))
        torch.manual_seed(100 + rank)  # a per-rank RNG state to restore
        engine.save_checkpoint(root, tag=f"s{stage}", client_state={"epoch": 3, "t": torch.arange(4)})
        draw = rng_draw()
        losses += train(engine, rank, world, range(5, 10))
        out[stage] = {"losses": losses, "draw": draw, **rank_state(engine)}
    return out


def _resume_and_reshard(rank: int, world: int, root: str, plan: list[tuple[str, int, str | None]],
                        resume: bool = True):
    """With ``resume`` (2 ranks), resume each saved stage at the same stage; then each
    (tag, stage, resave_tag) of ``plan``."""
    import zeal

    out = {"resume": {}, "reshard": {}}
    if world == 2 and resume:
        for stage in STAGES:
            torch.manual_seed(1)  # different init: everything must come from the checkpoint
            engine = zeal.initialize(TinyNet(), config(stage))
            client = engine.load_checkpoint(root, tag=f"s{stage}")
            draw = rng_draw()
            losses = train(engine, rank, world, range(5, 10))
            out["resume"][stage] = {"losses": losses, "draw": draw, "client": client, **rank_state(engine)}
    for tag, stage, resave in plan:
        torch.manual_seed(2)
        engine = zeal.initialize(TinyNet(), config(stage))
        engine.load_checkpoint(root, tag=tag)
        if resave:
            engine.save_checkpoint(root, tag=resave)
        params = engine.module_state_dict()
        losses = train(engine, rank, world, range(5, 8))  # training continues
        out["reshard"][(tag, stage)] = {"params": params, "losses": losses}
    return out


def assemble(folder: Path) -> dict[str, torch.Tensor]:
    """Full tensors by key (param/<n>, optim.<k>/<n>, buffer/<n>) plus scalar state, from
    any checkpoint (format 1 or 2)."""
    meta = read_meta(folder)
    shards = open_shards(folder, read_manifest(folder), meta)
    out = {}
    for name, kinds in shards.kinds.items():
        entry = meta["params"][name]
        for kind in kinds:
            dtype = getattr(torch, entry["dtype"]) if kind == "param" else torch.float32
            out[f"{kind}/{name}"] = shards.full(kind, name, entry["shape"], dtype)
    for key in shards.whole_keys:
        if key.startswith("buffer/"):
            out[key] = shards.whole(key)
    for name, sc in shards.scalars.items():
        for k, v in sc.items():
            out[f"scalar.{k}/{name}"] = torch.tensor(v[0])
    return out


def _same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), (what, sorted(set(a) ^ set(b)))
    for k in a:
        x, y = torch.as_tensor(np.asarray(a[k])), torch.as_tensor(np.asarray(b[k]))
        assert torch.equal(x, y), f"{what}: {k} differs (max |Δ| {(x.double() - y.double()).abs().max()})"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    straight = run_ranks(_straight_and_save, 2, str(root), timeout=150)
    return root, straight


@pytest.mark.timeout(300)
def test_resume_bit_exact_and_reshard_2_to_2(saved):
    root, straight = saved
    plan = [("s3", 1, "s3to1"), ("s1", 3, "s1to3"), ("s0", 2, "s0to2"), ("s2", 0, "s2to0")]
    res = run_ranks(_resume_and_reshard, 2, str(root), plan, timeout=200)
    for rank in range(2):
        for stage in STAGES:
            a, b = straight[rank][stage], res[rank]["resume"][stage]
            assert a["losses"][10:] == b["losses"], (stage, a["losses"][10:], b["losses"])
            assert a["draw"] == b["draw"], stage
            assert a["lr"] == b["lr"] and a["counters"] == b["counters"], stage
            _same(a["params"], b["params"], f"stage {stage} rank {rank} params")
            _same(a["masters"], b["masters"], f"stage {stage} rank {rank} masters")
            _same(a["opt"], b["opt"], f"stage {stage} rank {rank} optimizer")
            assert b["client"]["epoch"] == 3 and np.array_equal(b["client"]["t"], np.arange(4))
    for src, stage, resave in plan:
        _same(assemble(root / src), assemble(root / resave), f"{src} -> stage {stage}")
        src_stage = int(src[1])
        for rank in range(2):
            # the model after the load equals the model at save time (= straight run before step 5)
            got = res[rank]["reshard"][(src, stage)]["params"]
            want = assemble(root / src)
            for k, v in got.items():
                if f"param/{k}" in want:
                    assert torch.equal(torch.from_numpy(v), want[f"param/{k}"]), (src_stage, stage, k)
            assert all(np.isfinite(x) for x in res[rank]["reshard"][(src, stage)]["losses"])


@pytest.mark.timeout(300)
def test_reshard_2_to_4_to_2_and_to_1(saved):
    import zeal

    root, _ = saved
    plan4 = [("s1", 1, "w4s1"), ("s3", 3, "w4s3"), ("s2", 1, None)]
    res4 = run_ranks(_resume_and_reshard, 4, str(root), plan4, timeout=200)
    for src, _, resave in plan4:
        if resave:
            _same(assemble(root / src), assemble(root / resave), f"2->4 {src}")
    # 4 -> 2, across stages
    plan2 = [("w4s3", 1, "w4s3to2s1"), ("w4s1", 3, "w4s1to2s3")]
    run_ranks(_resume_and_reshard, 2, str(root), plan2, False, timeout=200)
    for src, _, resave in plan2:
        _same(assemble(root / src), assemble(root / resave), f"4->2 {src}")
    # 2 -> 1, in this process (world size 1 needs no process group)
    for tag, stage in [("s3", 0), ("s1", 3)]:
        torch.manual_seed(3)
        engine = zeal.initialize(TinyNet(), config(stage))
        engine.load_checkpoint(str(root), tag=tag)
        engine.save_checkpoint(str(root), tag=f"{tag}to1s{stage}")
        _same(assemble(root / tag), assemble(root / f"{tag}to1s{stage}"), f"2->1 {tag}")
        losses = train(engine, 0, 1, range(5, 7))
        assert all(np.isfinite(losses))
    assert res4[0]["reshard"][("s2", 1)]["losses"]


@pytest.mark.timeout(300)
def test_reshard_1_to_2_across_stages(tmp_path):
    import zeal

    for stage in (0, 3, 2):  # saved by one rank, in this process
        torch.manual_seed(0)
        engine = zeal.initialize(TinyNet(), config(stage))
        train(engine, 0, 1, range(0, 3))
        engine.save_checkpoint(str(tmp_path), tag=f"w1s{stage}")
    plan = [("w1s0", 3, "w1s0to2s3"), ("w1s3", 1, "w1s3to2s1"), ("w1s2", 2, "w1s2to2s2")]
    res = run_ranks(_resume_and_reshard, 2, str(tmp_path), plan, False, timeout=200)
    for src, stage, resave in plan:
        want = assemble(tmp_path / src)
        _same(want, assemble(tmp_path / resave), f"1->2 {src} -> stage {stage}")
        for rank in range(2):
            got = res[rank]["reshard"][(src, stage)]
            for k, v in got["params"].items():
                if f"param/{k}" in want:
                    assert torch.equal(torch.from_numpy(v), want[f"param/{k}"]), (src, stage, rank, k)
            assert all(np.isfinite(x) for x in got["losses"])
