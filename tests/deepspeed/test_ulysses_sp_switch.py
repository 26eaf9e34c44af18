"""ALST's Hugging Face entry points under zeal's DeepSpeed switch
(``deepspeed.runtime.sequence_parallel.ulysses_sp``, what Accelerate and TRL import).

* The import surface: the names Accelerate imports resolve to zeal's module, with the
  signature it inspects; ``eager`` and sp 1 behave as DeepSpeed's.
* A 2-rank run through it — ``register_with_transformers`` → ``deepspeed.initialize(mpu=...)``
  with no ``sequence_parallel_size`` in the config → ``UlyssesSPDataLoaderAdapter`` →
  Transformers' own ``deepspeed_sp_compute_loss`` (the Trainer's SP loss) — equals one
  process training on the same full sequences (HF Llama, GQA, ZeRO 1, fp32 SGD; losses
  and gradients 1e-5 as tests/parallel/test_ulysses.py).
"""

from __future__ import annotations

import inspect
import types

import pytest
import torch

from tests.dist_harness import run_ranks
from tests.parallel.test_ulysses import LR, MICRO, batches, build, check, reference

pytestmark = pytest.mark.timeout(120)
SEQ = 16


def test_import_surface_resolves_to_zeal():
    from zeal.deepspeed.switch import install, uninstall

    install()
    try:
        from deepspeed.runtime.sequence_parallel import parallel_state_sp
        from deepspeed.runtime.sequence_parallel.ulysses_sp import (
            TiledMLP,
            UlyssesSPAttentionHF,
            UlyssesSPDataLoaderAdapter,
        )

        import zeal.deepspeed.runtime.sequence_parallel.ulysses_sp as mine

        assert UlyssesSPAttentionHF is mine.UlyssesSPAttentionHF
        assert UlyssesSPDataLoaderAdapter is mine.UlyssesSPDataLoaderAdapter
        assert parallel_state_sp.get_model_parallel_world_size is parallel_state_sp.get_sequence_parallel_world_size
        params = inspect.signature(UlyssesSPAttentionHF.register_with_transformers).parameters
        for name in ("model_name_or_path", "core_attn_implementation", "sequence_parallel_size",
                     "micro_batch_size", "seq_length", "seq_length_is_variable", "disable_in_eval"):
            assert name in params  # what Accelerate passes (and inspects for disable_in_eval)
        model = build("hf_llama", SEQ)
        assert UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 1, MICRO) is None
        with pytest.raises(ValueError, match="eager attn_implementation isn't supported"):
            UlyssesSPAttentionHF.register_with_transformers(model, "eager", 2, MICRO)
        with pytest.raises(NotImplementedError, match="tiling.tiled_mlp"):
            TiledMLP.apply(None)
    finally:
        uninstall()


def _ranks(rank: int, world: int) -> dict:
    from zeal.deepspeed.switch import install

    install()
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import (
        UlyssesSPAttentionHF,
        UlyssesSPDataLoaderAdapter,
    )
    from transformers.integrations.deepspeed import deepspeed_sp_compute_loss

    deepspeed.init_distributed(dist_backend="gloo")
    model = build("hf_llama", SEQ)
    mpu = UlyssesSPAttentionHF.register_with_transformers(model_name_or_path=model, core_attn_implementation="sdpa",
                                                          sequence_parallel_size=2, micro_batch_size=MICRO,
                                                          seq_length=SEQ, seq_length_is_variable=True)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_optimization": {"stage": 1}}
    engine, *_ = deepspeed.initialize(model=model, config=cfg, mpu=mpu)
    ids, labels = batches(SEQ, True)
    pos = torch.arange(SEQ).expand(MICRO, SEQ)
    # rank r's loader holds step r's batch: the adapter runs rank 0's, then rank 1's
    loader = [{"input_ids": ids[rank], "labels": labels[rank], "position_ids": pos}]
    dl = UlyssesSPDataLoaderAdapter(loader, sp_rank=mpu.get_sequence_parallel_rank(),
                                    sp_group=mpu.get_sequence_parallel_group(),
                                    sp_world_size=mpu.get_sequence_parallel_world_size(), device="cpu")
    pc = types.SimpleNamespace(sp_backend="deepspeed", sp_size=2)
    losses, grads, shapes = [], [], []
    before = engine.module_state_dict()
    eps = torch.finfo(torch.float32).eps
    for batch in dl:
        shapes.append(tuple(batch["input_ids"].shape))
        loss = deepspeed_sp_compute_loss(None, engine, batch, False, pc)
        engine.backward(loss)
        engine.step()
        after = engine.module_state_dict()
        grads.append({n: ((before[n] - after[n]) / LR, float(((before[n].abs() + after[n].abs()) * eps / LR).norm()))
                      for n in after if after[n].is_floating_point()})
        before = after
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "shapes": shapes, "sp": engine.engine.mesh.sizes["sp"]}


def test_two_ranks_through_ulysses_sp_equal_one_process():
    out = run_ranks(_ranks, 2, timeout=100)
    ref = reference("hf_llama", SEQ, True)
    for r in range(2):
        assert out[r]["sp"] == 2 and out[r]["shapes"] == [(MICRO, SEQ // 2)] * 2
        check(out[r], ref, f"ulysses_sp rank {r}")
