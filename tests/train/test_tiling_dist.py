"""ALST tiling on 2 gloo ranks: ZeRO-3 (zeal's Llama, Hugging Face's Llama) and
vocabulary-parallel TP 2 train step by step as the same job untiled, and ZeRO-3 gathers a TiledMLP's parameters once per MLP call.

Reference: the same engine configuration without the ``tiling`` section, on the same
ranks and data. Tolerance 1e-6 relative on fp32 losses over 3 steps: the tiled
gradients differ from the untiled ones by summation order only (a few ulps), while a
tile's gradient dropped or reduced twice moves the next loss by more than 1e-3.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_harness import run_ranks

STEPS = 3
TILING = {"tiled_mlp": {"enabled": True, "num_shards": 3}, "tiled_logits_loss": {"enabled": True, "num_shards": 5}}


def _model():
    from zeal.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    # every linear is its own stage-3 unit below (no coalesced blocks): the case where a
    # TiledMLP could gather per tile
    return Llama(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2))


def _hf_model():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def _run(rank: int, cfg: dict, hf: bool = False) -> dict:
    import functools

    import zeal
    import zeal.zero.apply as zapply
    from zeal.zero.units import build_module_units

    zapply.build_module_units = functools.partial(build_module_units, coalesce_block_elems=0)  # a unit per linear
    engine = zeal.initialize(_hf_model() if hf else _model(), cfg)
    g = torch.Generator().manual_seed(7)
    losses, gathers = [], []
    for _ in range(STEPS):
        ids = torch.randint(0, 64, (4, 22), generator=g)
        labels = ids.clone()
        labels[1, 3:10] = -100
        rows = slice(2 * engine.mesh.dp_rank, 2 * engine.mesh.dp_rank + 2) if engine.mesh.dp_size > 1 else slice(0, 4)
        loss = engine(input_ids=ids[rows], labels=labels[rows])
        loss = loss.loss if hf else loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        last = engine.mesh.stats.last_step
        gathers.append(sum(c.calls for (op, _, _), c in last.items() if op == "all_gather"))
    engine.close()
    return {"losses": losses, "gathers": gathers}


def _ranks(rank: int, world: int) -> dict:
    base = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    z3 = {**base, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "activation_checkpointing": {}}
    tp = {**base, "train_micro_batch_size_per_gpu": 4, "tensor_parallel": {"autotp_size": 2},
          "zero_optimization": {"stage": 1}}
    return {"z3": _run(rank, z3), "z3_tiled": _run(rank, {**z3, "tiling": TILING}),
            "hf": _run(rank, z3, hf=True), "hf_tiled": _run(rank, {**z3, "tiling": TILING}, hf=True),
            "tp": _run(rank, tp), "tp_tiled": _run(rank, {**tp, "tiling": TILING})}


@pytest.mark.timeout(200)
def test_tiling_under_zero3_and_vocab_parallel_tp2():
    pytest.importorskip("transformers")
    results = run_ranks(_ranks, 2, timeout=180)
    for r in results:
        for case in ("z3", "tp", "hf"):
            want, got = r[case]["losses"], r[f"{case}_tiled"]["losses"]
            assert want[-1] != want[0]  # it trains
            for w, g in zip(want, got):
                assert abs(g - w) <= 1e-6 * abs(w), (case, got, want)
        # after the first (trace-recording) step a TiledMLP holds its MLP's units over the
        # whole call: no more all-gathers than untiled (gathered per tile it was 102 vs 56;
        # it is 52: the MLP is held over its backward, where the untiled linears go one by one)
        tiled, plain = r["z3_tiled"]["gathers"][1:], r["z3"]["gathers"][1:]
        assert all(0 < t <= p for t, p in zip(tiled, plain)), (tiled, plain)
