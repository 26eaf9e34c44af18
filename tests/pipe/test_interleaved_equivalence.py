"""The interleaved schedule on real gloo ranks matches the single-process run.

PP 2 with 2 virtual stages per rank (rank 0 holds chunks 0 and 2, rank 1 chunks 1 and 3),
on 2 ranks and, with data parallelism 2, on 4 ranks; ZeRO stage 1, fp32, 4 micro-batches
accumulated, clipping active. Models: a zeal GPT (4 blocks, one per chunk) with its head
tied to the embedding (the tied weight crosses from rank 0's chunk 0 to rank 1's chunk
1), and a ``PipelineModule`` of ``LayerSpec`` layers built with ``virtual_stages=2``.
Reference: :func:`tests.pipe.test_pipeline_equivalence._reference` (one process, the
whole model, the same micro-batches): every step's loss and gradient norm agree.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_harness import run_ranks
from tests.pipe.test_pipeline_equivalence import CLIP, MODELS, STEPS, M, _config, _data, _layers, _reference

V = 2


def _train(rank: int, world: int, names: list[str]) -> dict:
    import zeal
    from zeal.pipe import PipelineModule

    out = {}
    dp = world // 2
    for name in names:
        torch.manual_seed(0)
        if name == "layers":
            base = _layers(1, 0)
            model = PipelineModule(list(base.layers), loss_fn=base.loss_fn, num_stages=2, virtual_stages=V,
                                   partition_method="parameters")
        else:
            model = MODELS[name]()
        config = _config(2, "interleaved")
        config["pipeline_parallel"]["virtual_stages"] = V
        engine = zeal.initialize(model, config)
        x, y = _data(dp)
        labels = y if name == "layers" else x
        d = engine.mesh.dp_rank
        losses, norms = [], []
        for s in range(STEPS):
            losses.append(float(engine.train_batch(iter([(x[s, m, d], labels[s, m, d]) for m in range(M)]))))
            norms.append(engine.grad_norm)
        chunks = engine.stage.chunks
        out[name] = (losses, norms, chunks, engine.comm_stats()["total"]["by_dim"].get("pp", {}).get("bytes", 0))
        engine.close()
    return out


def _check(results, names, dp: int) -> None:
    for name in names:
        ref_losses, ref_norms = _reference(name, dp)
        assert max(ref_norms) > CLIP, "the test must exercise clipping"
        for r, res in enumerate(results):
            losses, norms, chunks, pp_bytes = res[name]
            assert chunks == V and pp_bytes > 0
            assert losses == pytest.approx(ref_losses, abs=1e-5, rel=0), (name, r)
            assert norms == pytest.approx(ref_norms, rel=1e-4), (name, r)


@pytest.mark.timeout(120)
def test_interleaved_pp2_matches_single_process():
    names = ["gpt", "layers"]
    _check(run_ranks(_train, 2, names, timeout=100), names, 1)


@pytest.mark.timeout(150)
def test_interleaved_pp2_dp2_matches_single_process():
    names = ["gpt"]
    _check(run_ranks(_train, 4, names, timeout=130), names, 2)
