"""The checkpoint matrix of 3D layouts: a zeal GPT (head tied to the embedding) trained at
TP 2 × DP 2 (ZeRO stage 1) and saved after 3 steps is loaded, in the same 4 gloo ranks, at
TP 2 × DP 2 again (the same layout), at DP 4 (no tensor parallelism, half the micro-batch
per rank) and at PP 2 × DP 2 (1F1B, the accumulation as pipeline micro-batches); all
continue with the losses of single-process training on the same global batches (plain
PyTorch, :func:`reference`). The same model trained at TP 2 (2 ranks, ZeRO stage 1) resumes
at TP 2 (stages 1 and 3) and at TP 1 × DP 2 (stage 2). The TP 1 × DP 1 load is in ``test_tensor_parallel.py``.

The other cells of the layout-resume matrix: PP 2 → PP 2 and PP 2 → one process in
``tests/pipe/test_pipeline_equivalence.py::test_pp2_checkpoint_loads_without_pipeline``;
EP 2 → EP 2, EP 1 × DP 2, EP 4, EP 2 × DP 2 and one process in ``tests/moe/test_checkpoint.py``."""

from __future__ import annotations

import pytest
import torch

from tests.dist_harness import run_ranks
from tests.parallel.test_tensor_parallel import (
    ACCUM,
    MICRO,
    SAVE_AT,
    STEPS,
    batches,
    build,
    config,
    reference,
    train,
)

pytestmark = pytest.mark.timeout(150)


def _resume_dp4(save_dir: str) -> list[tuple[int, int, float]]:
    import zeal

    engine = zeal.initialize(build("gpt"), {**config(1, tp=1), "train_micro_batch_size_per_gpu": MICRO // 2})
    engine.load_checkpoint(save_dir, tag="mid")
    assert engine.mesh.dp_size == 4 and engine.global_steps == SAVE_AT
    r, ids, losses = engine.mesh.dp_rank, batches(2), []
    half = MICRO // 2
    for s in range(SAVE_AT, STEPS):
        for a in range(ACCUM):  # dp rank r holds half of the old dp rank r // 2's micro-batch
            loss = engine(input_ids=ids[s, a, r // 2][(r % 2) * half:(r % 2 + 1) * half],
                          labels=ids[s, a, r // 2][(r % 2) * half:(r % 2 + 1) * half])
            engine.backward(loss)
            engine.step()
            losses.append((s, a, loss.item()))
    engine.close()
    return losses


def _resume_same(save_dir: str, stage: int = 1) -> list[tuple[int, int, int, float]]:
    """Load at the layout that saved (TP 2, the rest over dp) and train the remaining steps."""
    import zeal

    torch.manual_seed(1)  # another init: everything must come from the checkpoint
    engine = zeal.initialize(build("gpt"), config(stage))
    engine.load_checkpoint(save_dir, tag="mid")
    assert engine.mesh.tp_size == 2 and engine.global_steps == SAVE_AT
    d, ids, losses = engine.mesh.dp_rank, batches(engine.mesh.dp_size), []
    for s in range(SAVE_AT, STEPS):
        for a in range(ACCUM):
            loss = engine(input_ids=ids[s, a, d], labels=ids[s, a, d])
            engine.backward(loss)
            engine.step()
            losses.append((s, a, d, loss.item()))
    engine.close()
    return losses


def _resume_pp2_dp2(save_dir: str) -> list[tuple[int, float]]:
    import zeal

    cfg = {**config(1, tp=1), "pipeline_parallel": {"size": 2, "micro_batches": ACCUM, "schedule": "1f1b"}}
    engine = zeal.initialize(build("gpt"), cfg)
    engine.load_checkpoint(save_dir, tag="mid")
    assert engine.mesh.pp_size == 2 and engine.mesh.dp_size == 2 and engine.global_steps == SAVE_AT
    d, ids, losses = engine.mesh.dp_rank, batches(2), []
    for s in range(SAVE_AT, STEPS):
        losses.append((s, float(engine.train_batch(iter([(ids[s, a, d], ids[s, a, d]) for a in range(ACCUM)])))))
    engine.close()
    return losses


def _ranks(rank: int, world: int, save_dir: str) -> dict:
    losses, _, engine = train(rank, "gpt", 1, save_dir)
    engine.close()
    return {"tp2dp2": losses, "same": _resume_same(save_dir), "dp4": _resume_dp4(save_dir),
            "pp2dp2": _resume_pp2_dp2(save_dir)}


def _resume_dp2(save_dir: str) -> list[tuple[int, int, float]]:
    """The TP 2 checkpoint at TP 1 × DP 2, ZeRO stage 2: each rank half the micro-batch."""
    import zeal

    engine = zeal.initialize(build("gpt"), {**config(2, tp=1), "train_micro_batch_size_per_gpu": MICRO // 2})
    engine.load_checkpoint(save_dir, tag="mid")
    assert engine.mesh.dp_size == 2 and engine.global_steps == SAVE_AT
    r, ids, losses, half = engine.mesh.dp_rank, batches(1), [], MICRO // 2
    for s in range(SAVE_AT, STEPS):
        for a in range(ACCUM):
            part = ids[s, a, 0][r * half:(r + 1) * half]
            loss = engine(input_ids=part, labels=part)
            engine.backward(loss)
            engine.step()
            losses.append((s, a, loss.item()))
    engine.close()
    return losses


def _tp2_ranks(rank: int, world: int, save_dir: str) -> dict:
    losses, _, engine = train(rank, "gpt", 1, save_dir)
    engine.close()
    return {"tp2": losses, "same": _resume_same(save_dir), "stage3": _resume_same(save_dir, stage=3),
            "dp2": _resume_dp2(save_dir)}


def test_tp2_checkpoint_resumes_at_tp2_and_dp2(tmp_path):
    """Regression: a TP engine compared the saved global shapes with its local slices."""
    results = run_ranks(_tp2_ranks, 2, str(tmp_path / "ckpt"), timeout=140)
    ref = reference("gpt", 1)
    for res in results:
        assert [(s, a) for s, a, _, _ in res["same"]] == [(s, a) for s in range(SAVE_AT, STEPS) for a in range(ACCUM)]
        for key in ("tp2", "same", "stage3"):
            for s, a, d, loss in res[key]:
                assert loss == pytest.approx(ref[s][a][d], abs=1e-5), (key, s, a, d)
    for s in range(SAVE_AT, STEPS):
        for a in range(ACCUM):  # the two halves of the micro-batch average to its loss
            pair = [dict(((s_, a_), v) for s_, a_, v in results[r]["dp2"])[(s, a)] for r in (0, 1)]
            assert sum(pair) / 2 == pytest.approx(ref[s][a][0], abs=1e-5), ("dp2", s, a)


def test_tp2_dp2_checkpoint_continues_at_dp4_and_pp2_dp2(tmp_path):
    results = run_ranks(_ranks, 4, str(tmp_path / "ckpt"), timeout=140)
    ref = reference("gpt", 2)
    for res in results:
        assert len(res["same"]) == (STEPS - SAVE_AT) * ACCUM
        for key in ("tp2dp2", "same"):
            for s, a, d, loss in res[key]:
                assert loss == pytest.approx(ref[s][a][d], abs=1e-5), (key, s, a, d)
    for s in range(SAVE_AT, STEPS):
        for a in range(ACCUM):  # the two halves of each old micro-batch average to its loss
            for d in range(2):
                pair = [dict(((s_, a_), v) for s_, a_, v in results[r]["dp4"])[(s, a)] for r in (2 * d, 2 * d + 1)]
                assert sum(pair) / 2 == pytest.approx(ref[s][a][d], abs=1e-5), ("dp4", s, a, d)
    expected = {s: sum(ref[s][a][d] for a in range(ACCUM) for d in range(2)) / (2 * ACCUM) for s in range(STEPS)}
    for res in results:
        assert [s for s, _ in res["pp2dp2"]] == list(range(SAVE_AT, STEPS))
        for s, loss in res["pp2dp2"]:
            assert loss == pytest.approx(expected[s], abs=1e-5), ("pp2dp2", s)
