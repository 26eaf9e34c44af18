"""PEFT interop both ways (equal logits), merged export (equal to base + adapter),
QLoRA against LoRA on the dequantized base, activation checkpointing, config errors.

Tolerances: logits of the same weights through zeal's and HF's Llama agree to ~1e-6
(attention's summation order); 1e-5 absolute on logits of magnitude ~1 leaves room for
that and still fails for a missing adapter (delta ~1e-2) or a wrong scale."""

from __future__ import annotations

import pytest
import torch

from tests.lora.lora_cases import (
    LR,
    data,
    engine_config,
    hf_model,
    peft_losses,
    peft_model,
    write_initial_adapter,
    zeal_losses,
    zeal_model,
)
from tests.needs import needs

pytestmark = needs("transformers", "peft")

IDS = torch.tensor([[3, 14, 15, 9, 26, 5, 35, 8]])


def _logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        out = model(IDS)
    return out.logits if hasattr(out, "logits") else out


def test_peft_saved_adapter_loaded_by_zeal(tmp_path):
    from zeal.lora.merge import attach_adapter

    pm = peft_model(target_modules=["q_proj", "k_proj", "down_proj"], use_rslora=True, modules_to_save=["lm_head"])
    with torch.no_grad():
        pm.base_model.model.lm_head.modules_to_save["default"].weight.mul_(1.5)  # a saved module that differs
    pm.save_pretrained(str(tmp_path))
    want = _logits(pm)
    for base in (zeal_model(), hf_model()):  # zeal's Llama and HF's own model
        attach_adapter(base, tmp_path)
        torch.testing.assert_close(_logits(base), want, rtol=0, atol=1e-5)
    assert (want - _logits(hf_model())).abs().max() > 1e-2  # the adapter matters


def test_zeal_saved_adapter_loaded_by_peft(tmp_path):
    import zeal

    write_initial_adapter(tmp_path / "init", modules_to_save=["lm_head"])
    engine = zeal.initialize(zeal_model(), engine_config(tmp_path / "init"))
    zeal_losses(engine, None)
    engine.save_adapter(str(tmp_path / "out"))
    want = _logits(engine.module)
    engine.close()
    import peft

    pm = peft.PeftModel.from_pretrained(hf_model(), str(tmp_path / "out"))
    torch.testing.assert_close(_logits(pm), want, rtol=0, atol=1e-5)


def test_merged_export_equals_base_plus_adapter(tmp_path):
    import transformers

    import zeal
    from zeal.checkpoint.export import export_hf
    from zeal.checkpoint.files import CheckpointError
    from zeal.lora.merge import merge_and_unload

    write_initial_adapter(tmp_path / "init")
    engine = zeal.initialize(zeal_model(), engine_config(tmp_path / "init"))
    zeal_losses(engine, None)
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
    want = _logits(engine.module)
    merge_and_unload(engine.module)
    assert not any(".lora_" in n for n, _ in engine.module.named_parameters())
    torch.testing.assert_close(_logits(engine.module), want, rtol=0, atol=1e-5)
    engine.close()
    with pytest.raises(CheckpointError, match="--merge-lora"):
        export_hf(tmp_path / "ckpt", tmp_path / "plain")
    export_hf(tmp_path / "ckpt", tmp_path / "hf", merge_lora=True)
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    torch.testing.assert_close(_logits(merged), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_qlora_equals_lora_on_dequantized_base(tmp_path, kind):
    import zeal
    from zeal.lora.quant import dequantize, quantize

    write_initial_adapter(tmp_path)
    ref = zeal_model()
    with torch.no_grad():
        for name, m in ref.named_modules():
            if isinstance(m, torch.nn.Linear) and name != "lm_head":
                m.weight.copy_(dequantize(*quantize(m.weight, kind, 16), kind, torch.float32))
    lora = zeal.initialize(ref, engine_config(tmp_path))
    want = zeal_losses(lora, None)
    lora.close()
    cfg = engine_config(tmp_path)
    cfg["lora"].update(quantize_base=kind, quant_block_size=16)
    q = zeal.initialize(zeal_model(), cfg)
    q_proj = q.module.model.layers[0].self_attn.q_proj
    assert q_proj.weight is None and q_proj.qweight.dtype == (torch.uint8 if kind == "int4" else torch.int8)
    got = zeal_losses(q, None)
    q.close()
    for g, w in zip(got, want):
        assert abs(g - w) <= 1e-5 * abs(w), (got, want)
    assert abs(want[0] - peft_losses()[0]) > (1e-4 if kind == "int4" else 1e-6)  # quantization changed the base


def test_quantize_roundtrip_bounds():
    from zeal.lora.quant import dequantize, quantize, quantized_bytes

    w = torch.randn(8, 64)
    for kind, qmax in (("int8", 127), ("int4", 7)):
        codes, scale = quantize(w, kind, 32)
        back = dequantize(codes, scale, kind, torch.float32)
        step = w.reshape(8, 2, 32).abs().amax(-1) / qmax
        assert ((back - w).abs().reshape(8, 2, 32) <= step[..., None] / 2 + 1e-6).all()
        assert codes.numel() * codes.element_size() + scale.numel() * 4 == quantized_bytes(8, 64, kind, 32)


def test_activation_checkpointing_equals_peft(tmp_path):
    import zeal

    write_initial_adapter(tmp_path)
    engine = zeal.initialize(zeal_model(), engine_config(tmp_path, activation_checkpointing={"number_checkpoints": 1}))
    assert engine.module.checkpoint_activations
    got = zeal_losses(engine, None)
    engine.close()
    want = peft_losses()
    for g, w in zip(got, want):
        assert abs(g - w) <= 1e-5 * abs(w), (got, want)


def test_config_errors(tmp_path):
    import zeal
    from zeal.config import ConfigError

    base = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": LR}}}
    with pytest.raises(ConfigError, match="matches no module"):
        zeal.initialize(zeal_model(), {**base, "lora": {"enabled": True, "target_modules": ["nope"]}})
    with pytest.raises(ConfigError, match="nn.Linear modules only"):
        zeal.initialize(zeal_model(), {**base, "lora": {"enabled": True, "target_modules": ["input_layernorm"]}})
    with pytest.raises(ConfigError, match="does not exist"):
        zeal.initialize(zeal_model(), {**base, "lora": {"enabled": True, "adapter": str(tmp_path / "x")}})
    write_initial_adapter(tmp_path)
    with pytest.raises(ConfigError, match="lora.r = 16 disagrees"):
        zeal.initialize(zeal_model(), {**base, "lora": {"enabled": True, "adapter": str(tmp_path), "r": 16}})
    assert len(data()) == 3
