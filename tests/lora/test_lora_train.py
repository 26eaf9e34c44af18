"""LoRA training against PEFT: per-step losses of zeal's engine equal PEFT's on the same
HF Llama with the same initial adapter (fp32, 1e-5 relative), in one process at ZeRO 0
and on 2 gloo ranks at ZeRO 1-3; only the adapters (and modules_to_save) are trained.

Tolerance: 1e-5 relative as in tests/zero/test_llama_zero.py (attention's summation order
and the 2-rank gradient average differ by a few ulps; a missed adapter gradient or a
wrongly frozen parameter moves the loss by far more than 1e-3 over 3 steps at lr 1e-2).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_harness import RankPool
from tests.lora.lora_cases import (
    WORLD,
    engine_config,
    peft_losses,
    write_initial_adapter,
    zeal_losses,
    zeal_model,
)
from tests.needs import needs

pytestmark = needs("transformers", "peft")


def _close(got: list[float], want: list[float], what: str) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= 1e-5 * abs(w), f"{what} step {i}: {got} vs {want}"
    assert len({round(w, 4) for w in want}) == len(want)  # the adapters moved


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kw", [{}, {"target_modules": ["q_proj", "v_proj"], "modules_to_save": ["lm_head"],
                                     "use_rslora": True}], ids=["all-linear", "qv-rslora-lm_head"])
def test_zero0_one_process_equals_peft(tmp_path, kw):
    import zeal

    write_initial_adapter(tmp_path, **kw)
    engine = zeal.initialize(zeal_model(), engine_config(tmp_path))
    trainable = {n for n, p in engine.module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n or n.startswith("lm_head") for n in trainable)
    assert ("lm_head.weight" in trainable) == ("modules_to_save" in kw)
    got = zeal_losses(engine, None)
    engine.close()
    _close(got, peft_losses(**kw), "zero 0")


def _rank(rank, world, folder, stage):
    import zeal

    engine = zeal.initialize(zeal_model(), engine_config(folder, stage))
    losses = zeal_losses(engine, rank)
    from tests.lora.test_lora_estimate import held_states

    held = held_states(engine)
    engine.close()
    return losses, held


@pytest.fixture(scope="module")
def pool():
    p = RankPool(WORLD)
    yield p
    p.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_on_two_ranks_equal_peft(pool, tmp_path, stage):
    write_initial_adapter(tmp_path)
    results = pool.run(_rank, str(tmp_path), stage, timeout=100)
    got = [sum(r[0][i] for r in results) / WORLD for i in range(len(results[0][0]))]
    _close(got, peft_losses(), f"stage {stage}")
    from tests.lora.test_lora_estimate import planned_states

    want = planned_states(stage, WORLD)  # zeal estimate's model states per rank
    assert all(abs(held - want) <= 0.01 * want for _, held in results), ([h for _, h in results], want)


def test_only_adapters_get_optimizer_state(tmp_path):
    import zeal

    write_initial_adapter(tmp_path)
    model = zeal_model()
    n_lora = None
    engine = zeal.initialize(model, engine_config(tmp_path))
    n_lora = sum(p.numel() for n, p in engine.module.named_parameters() if ".lora_" in n)
    opt_elems = sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"])
    assert opt_elems == n_lora
    base = engine.module.model.layers[0].self_attn.q_proj.weight.detach().clone()
    zeal_losses(engine, None)
    assert torch.equal(base, engine.module.model.layers[0].self_attn.q_proj.weight)  # frozen base untouched
    engine.close()


@pytest.mark.timeout(120)
def test_sync_stream_merged_zero3_two_ranks(pool, tmp_path):
    """The hybrid engine's weight sync at ZeRO 3: base and factors arrive unit by unit."""
    from tests.lora.test_lora_rlhf import _sync

    write_initial_adapter(tmp_path)
    assert max(pool.run(_sync, str(tmp_path), 3, timeout=100)) <= 1e-6


@pytest.mark.timeout(120)
def test_adapter_only_sync_zero3_two_ranks(pool, tmp_path):
    """At ZeRO 3 the hybrid engine's later syncs gather the adapters' units alone; the
    serving base keeps its bytes and generations follow the trained adapters."""
    from tests.lora.test_lora_adapter_sync import adapter_sync_case, check

    write_initial_adapter(tmp_path)
    for res in pool.run(adapter_sync_case, str(tmp_path), 3, timeout=100):
        check(res, 3)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("offload", [{"offload_optimizer": {"device": "cpu"}},
                                     {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}],
                         ids=["optimizer", "optimizer+param"])
def test_zero3_offload_one_process_equals_peft(tmp_path, offload):
    """ZeRO 3 with the optimizer (and parameters) offloaded: only the adapters' state is
    offloaded, the losses stay PEFT's."""
    import zeal

    write_initial_adapter(tmp_path)
    cfg = engine_config(tmp_path, 3)
    cfg["zero_optimization"].update(offload)
    engine = zeal.initialize(zeal_model(), cfg)
    got = zeal_losses(engine, None)
    engine.close()
    _close(got, peft_losses(), f"offload {sorted(offload)}")
