"""Tensor × pipeline parallelism: TP 2 × PP 2 on 4 gloo ranks — a zeal GPT with its head tied
to the embedding across the first and last stage, and a zeal Llama with GQA — ZeRO stage 1,
1F1B, the accumulation as pipeline micro-batches, clipping on: the losses and global gradient
norms of every step equal the single-process run (the pipeline test's :func:`_reference`).

The vocabulary is split over tp on both ends (the first stage's embedding, the last stage's
head and its tied copy: V/2 rows each, with the vocabulary-parallel cross-entropy), and the
RNG tracker's model-parallel stream is seeded per (tp, pp) coordinate: its first draws equal
``torch.Generator`` seeded ``seed + 100·pp_rank + 2718 + tp_rank`` and differ over the 4 ranks."""

from __future__ import annotations

import pytest
import torch

from tests.dist_harness import run_ranks
from tests.pipe.test_pipeline_equivalence import CLIP, MODELS, STEPS, VOCAB, M, _config, _data, _reference

pytestmark = pytest.mark.timeout(150)


def _train_tp_pp(rank: int, world: int, names: list[str]) -> dict:
    import zeal
    from zeal.parallel.rng import get_rng_tracker

    out = {}
    for name in names:
        torch.manual_seed(0)
        engine = zeal.initialize(MODELS[name](), {**_config(2, "1f1b"), "tensor_parallel": {"autotp_size": 2}})
        mesh = engine.mesh
        assert (mesh.tp_size, mesh.pp_size, mesh.dp_size) == (2, 2, 1)
        ends = engine.module.lm_head if engine.stage.last else engine.module.get_submodule(
            "transformer.wte" if name == "gpt" else "model.embed_tokens")
        rows = ends.weight.shape[0]  # the head's weight: a parameter, or the tied copy the engine installed
        with get_rng_tracker().fork():
            draw = torch.rand(4).tolist()
        x, _ = _data(1)
        losses, norms = [], []
        for s in range(STEPS):
            losses.append(float(engine.train_batch(iter([(x[s, m, 0], x[s, m, 0]) for m in range(M)]))))
            norms.append(engine.grad_norm)
        total = engine.comm_stats()["total"]
        by_dim, vocab_bytes = total["by_dim"], total["by_kind"].get("vocab", {}).get("bytes", 0)
        out[name] = (losses, norms, by_dim.get("pp", {}).get("bytes", 0), by_dim.get("tp", {}).get("bytes", 0),
                     rows, vocab_bytes, draw, (mesh.tp_rank, mesh.pp_rank))
        engine.close()
    return out


def test_tp2_pp2_matches_single_process():
    names = ["gpt", "llama"]
    from zeal.parallel.rng import PP_SEED_STRIDE, SEED_OFFSET

    results = run_ranks(_train_tp_pp, 4, names, timeout=140)
    for name in names:
        ref_losses, ref_norms = _reference(name, 1)
        assert max(ref_norms) > CLIP, "the test must exercise clipping"
        draws = []
        for r, res in enumerate(results):
            losses, norms, pp_bytes, tp_bytes, rows, vocab_bytes, draw, (tp_rank, pp_rank) = res[name]
            assert losses == pytest.approx(ref_losses, abs=1e-5, rel=0), (name, r)
            assert norms == pytest.approx(ref_norms, rel=1e-4), (name, r)
            assert pp_bytes > 0 and tp_bytes > 0  # both dimensions really carried traffic
            assert rows == VOCAB // 2 and vocab_bytes > 0, (name, r)  # embedding / head split by vocabulary
            seed = 1234 + PP_SEED_STRIDE * pp_rank + SEED_OFFSET + tp_rank  # the config's default seed
            assert draw == torch.rand(4, generator=torch.Generator().manual_seed(seed)).tolist(), (name, r)
            draws.append(draw)
        assert len({tuple(d) for d in draws}) == 4  # each (tp, pp) coordinate its own stream
