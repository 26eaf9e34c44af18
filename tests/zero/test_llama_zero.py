"""zeal's own Llama trains under ZeRO stages 0-3 on 2 gloo ranks exactly as Hugging Face's
``LlamaForCausalLM`` with the same weights trains in one plain PyTorch process.

Tolerance: fp32 losses to 1e-5 relative, as in ``test_stage3_hf``. The two models run
the same arithmetic per layer except attention, where HF's eager path (matmul,
softmax, matmul) and zeal's ``scaled_dot_product_attention`` sum in another order,
and the data-parallel gradient average, which adds the two ranks' halves where the
reference sums the whole batch at once: a few ulps per step (measured ~1e-7
relative), well under 1e-5, while one wrong step (a missed gradient, a wrong shard,
a head not tied) moves the loss by more than 1e-3.
"""

from __future__ import annotations

import pytest

from tests.dist_harness import RankPool

pytest.importorskip("transformers")

# the same HF model, data and hyper-parameters as the stage-3 HF test
from tests.zero.test_stage3_hf import LR, MICRO, STEPS, WORLD, _data, plain_losses  # noqa: E402
from tests.zero.test_stage3_hf import _model as _hf  # noqa: E402


def _zeal(tied: bool):
    """zeal's Llama holding the HF model's weights (same names, no renaming)."""
    from zeal.models.llama import Llama, LlamaConfig

    hf = _hf(tied)
    model = Llama(LlamaConfig.from_hf(hf.config.to_dict()))
    model.load_state_dict(hf.state_dict(), strict=True)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    return model


def _reference(tied: bool) -> list[float]:
    return plain_losses(_hf(tied))


def _train(rank, world, stage, tied, checkpointing):
    import zeal

    model = _zeal(tied)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if checkpointing:
        cfg["activation_checkpointing"] = {"number_checkpoints": 1}
    engine = zeal.initialize(model, cfg)
    assert engine.module.checkpoint_activations == checkpointing
    engine.train()
    losses = []
    for per_rank in _data():
        ids = per_rank[rank]
        loss = engine(ids, labels=ids)  # zeal's convention: the loss tensor itself
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.close()
    return losses


@pytest.fixture(scope="module")
def pool():
    p = RankPool(WORLD)
    yield p
    p.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage,tied,checkpointing", [
    (0, True, False), (1, True, False), (2, True, False), (3, True, False),
    (0, False, False), (1, False, False), (2, False, False), (3, False, False), (3, False, True),
], ids=lambda v: str(v))
def test_zeal_llama_trains_like_hf_llama(pool, stage, tied, checkpointing):
    want = _reference(tied)
    results = pool.run(_train, stage, tied, checkpointing, timeout=200)
    got = [sum(r[i] for r in results) / WORLD for i in range(STEPS)]
    for i, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= 1e-5 * abs(w), f"stage {stage} step {i}: {got} vs {want}"
    assert len({round(w, 4) for w in want}) == STEPS  # the weights moved: not a comparison of constants
