"""Tensor × pipeline parallelism: TP 2 × PP 2 on 4 gloo ranks — a zeal GPT with its head tied
to the embedding across the first and last stage, and a zeal Llama with GQA — ZeRO stage 1,
1F1B, the accumulation as pipeline micro-batches, clipping on: the losses and global gradient
norms of every step equal the single-process run (the pipeline test's :func:`_reference`)."""

from __future__ import annotations

import pytest
import torch

from tests.dist_harness import run_ranks
from tests.pipe.test_pipeline_equivalence import CLIP, MODELS, STEPS, M, _config, _data, _reference

pytestmark = pytest.mark.timeout(150)


def _train_tp_pp(rank: int, world: int, names: list[str]) -> dict:
    import zeal

    out = {}
    for name in names:
        torch.manual_seed(0)
        engine = zeal.initialize(MODELS[name](), {**_config(2, "1f1b"), "tensor_parallel": {"autotp_size": 2}})
        assert (engine.mesh.tp_size, engine.mesh.pp_size, engine.mesh.dp_size) == (2, 2, 1)
        x, _ = _data(1)
        losses, norms = [], []
        for s in range(STEPS):
            losses.append(float(engine.train_batch(iter([(x[s, m, 0], x[s, m, 0]) for m in range(M)]))))
            norms.append(engine.get_global_grad_norm())
        by_dim = engine.comm_stats()["total"]["by_dim"]
        out[name] = (losses, norms, by_dim.get("pp", {}).get("bytes", 0), by_dim.get("tp", {}).get("bytes", 0))
        engine.close()
    return out


def test_tp2_pp2_matches_single_process():
    names = ["gpt", "llama"]
    results = run_ranks(_train_tp_pp, 4, names, timeout=140)
    for name in names:
        ref_losses, ref_norms = _reference(name, 1)
        assert max(ref_norms) > CLIP, "the test must exercise clipping"
        for r, res in enumerate(results):
            losses, norms, pp_bytes, tp_bytes = res[name]
            assert losses == pytest.approx(ref_losses, abs=1e-5, rel=0), (name, r)
            assert norms == pytest.approx(ref_norms, rel=1e-4), (name, r)
            assert pp_bytes > 0 and tp_bytes > 0  # both dimensions really carried traffic
