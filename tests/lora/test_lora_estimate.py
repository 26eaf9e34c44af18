"""`zeal estimate` with LoRA / QLoRA: the planner's per-rank model states equal what the
engine holds (``engine.memory_breakdown()`` for the adapters' params, gradients and
optimizer state; the frozen parameters' and quantized codes' bytes counted from the
module), at ZeRO 0 in one process here and at ZeRO 1-3 on 2 ranks in
tests/lora/test_lora_train.py; and the CLI prints the LoRA table.

Tolerance: exact at one rank; on 2 ranks each flat unit is padded to a multiple of 2
elements, so within 1 % (the formula pads the total once)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.lora.lora_cases import engine_config, hf_model, write_initial_adapter, zeal_model
from tests.needs import needs

pytestmark = needs("transformers", "peft")


def planned_states(stage: int, world: int, quant: str = "none") -> int:
    from zeal.zero.estimate import hf_shape
    from zeal.zero.estimate_lora import LoraSpec, lora_plan

    spec = LoraSpec(4, "all-linear", quantize_base=quant, quant_block_size=16, kv_heads=2)  # lora_cases' adapter
    return lora_plan(hf_shape(hf_model().config.to_dict()), world, stage, "none", spec, mixed_precision=False).states.total


def held_states(engine) -> int:
    """Adapter states (memory_breakdown) + frozen parameters + quantized codes, this rank."""
    held = engine.memory_breakdown()
    frozen = held["frozen"] or sum(p.numel() * p.element_size() for p in engine.module.parameters()
                                   if not p.requires_grad)
    codes = sum(b.numel() * b.element_size() for n, b in engine.module.named_buffers()
                if n.endswith(("qweight", "qscale")))
    return held["total"] + frozen + codes


@pytest.mark.parametrize("quant", ["none", "int4"])
def test_planner_states_equal_the_engine_zero0(tmp_path, quant):
    import zeal

    write_initial_adapter(tmp_path)
    cfg = engine_config(tmp_path, 0)
    cfg["lora"].update(quantize_base=quant, quant_block_size=16)
    engine = zeal.initialize(zeal_model(), cfg)
    ids = torch.randint(0, 60, (2, 8), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(ids, labels=ids))
    engine.step()
    assert held_states(engine) == planned_states(0, 1, quant)
    engine.close()


def test_estimate_cli_lora_and_qlora(tmp_path, capsys):
    from zeal.cli.main import main

    (tmp_path / "config.json").write_text(json.dumps(hf_model().config.to_dict()))
    rows = {}
    for flag in (None, "r=4,target_modules=all-linear", "r=4,target_modules=all-linear,quantize_base=int8,"
                 "quant_block_size=16"):
        argv = ["estimate", "--hf-config", str(tmp_path), "--precision", "fp32", "--json", "--world-size", "2"]
        assert main(argv + (["--lora", flag] if flag else [])) == 0
        plans = json.loads(capsys.readouterr().out)["plans"]
        rows[flag] = next(p for p in plans if p["stage"] == 3 and p["offload"] == "none")
    full, lora, qlora = rows.values()
    assert lora["optimizer"] < full["optimizer"] / 4 and lora["grads"] < full["grads"] / 4  # 4096 of 22880
    assert qlora["params"] < lora["params"]  # int8 codes + scales below the fp32 shard
    assert qlora["params"] + qlora["grads"] + qlora["optimizer"] == planned_states(3, 2, "int8")
    assert main(["estimate", "--hf-config", str(tmp_path), "--lora", "target_modules=nope"]) == 2
    assert "matches none of the block's linears" in capsys.readouterr().err


def test_the_dense_planner_hands_a_lora_spec_its_own_planner():
    """``plan(lora=spec)`` (what `zeal estimate --lora` calls) is the LoRA planner's plan after
    the dense planner's argument checks; zero/estimate.py imports nothing of estimate_lora."""
    from zeal.zero.estimate import gpt_shape, plan
    from zeal.zero.estimate_lora import LoraSpec, lora_plan

    shape, spec = gpt_shape(2, 64, 4, 256, 64), LoraSpec(4, ("c_attn",))
    kw = dict(micro_batch=2, seq_len=32, checkpointing=True, host=False)
    assert plan(shape, 2, 3, "cpu_optimizer", lora=spec, **kw) == lora_plan(shape, 2, 3, "cpu_optimizer", spec, **kw)
    assert plan(shape, 2, 2, lora=spec).notes and not plan(shape, 2, 2).notes
    with pytest.raises(ValueError, match="needs zero_optimization.stage 3"):
        plan(shape, 2, 2, "nvme_params", lora=spec)
