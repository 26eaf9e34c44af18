"""zeal.lora.peft_folder against peft itself: a folder PEFT writes is read with the same
tensors and scales; the modules zeal matches are the ones PEFT adapts (names, regex,
all-linear, layers_to_transform, exclude); a folder zeal writes PEFT loads with the same
tensors; bad folders get one-line errors."""

from __future__ import annotations

import json

import pytest
import torch

from tests.needs import needs
from zeal.lora.peft_folder import (
    LoraPair,
    PeftAdapter,
    PeftLoraConfig,
    match_modules_to_save,
    match_target_modules,
    read_adapter,
    read_adapter_config,
    write_adapter,
)

pytestmark = needs("peft", "transformers")


def _hf_llama(seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def _peft_targets(model, **kw) -> set[str]:
    import peft

    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, **kw))
    return {n.removeprefix("base_model.model.") for n, m in pm.named_modules()
            if isinstance(m, peft.tuners.lora.LoraLayer)}


@pytest.mark.parametrize("kw", [
    {"target_modules": ["q_proj", "v_proj"]},
    {"target_modules": "all-linear"},
    {"target_modules": r".*\.mlp\.(gate|up)_proj"},
    {"target_modules": ["q_proj", "down_proj"], "layers_to_transform": [1]},
    {"target_modules": "all-linear", "exclude_modules": ["o_proj"]},
], ids=["list", "all-linear", "regex", "layers", "exclude"])
def test_matching_equals_peft(kw):
    model = _hf_llama()
    names = [n for n, _ in model.named_modules()]
    linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    ours = match_target_modules(PeftLoraConfig(**kw), names, linear)
    assert set(ours) == _peft_targets(_hf_llama(), **kw)


def test_modules_to_save_matching():
    cfg = PeftLoraConfig(target_modules=["q_proj"], modules_to_save=["lm_head", "norm"])
    names = [n for n, _ in _hf_llama().named_modules()]
    assert match_modules_to_save(cfg, names) == ["model.norm", "lm_head"]
    assert "lm_head" not in match_target_modules(PeftLoraConfig(target_modules="all-linear",
                                                                modules_to_save=["lm_head"]), names)


def test_read_folder_peft_wrote(tmp_path):
    import peft

    pm = peft.get_peft_model(_hf_llama(), peft.LoraConfig(r=4, lora_alpha=12, target_modules=["q_proj", "up_proj"],
                                                         use_rslora=True, modules_to_save=["lm_head"],
                                                         init_lora_weights=False, rank_pattern={"up_proj": 2}))
    pm.save_pretrained(tmp_path)
    ad = read_adapter(tmp_path)
    assert ad.config.use_rslora and ad.config.r == 4 and ad.config.modules_to_save == ["lm_head"]
    assert sorted(ad.lora) == sorted(f"model.layers.{i}.{m}" for i in range(2)
                                     for m in ("self_attn.q_proj", "mlp.up_proj"))
    q = pm.base_model.model.model.layers[1].self_attn.q_proj
    pair = ad.lora["model.layers.1.self_attn.q_proj"]
    assert torch.equal(pair.A, q.lora_A["default"].weight) and torch.equal(pair.B, q.lora_B["default"].weight)
    assert pair.scaling == pytest.approx(q.scaling["default"])
    up = pm.base_model.model.model.layers[0].mlp.up_proj
    assert ad.lora["model.layers.0.mlp.up_proj"].rank == 2
    assert ad.lora["model.layers.0.mlp.up_proj"].scaling == pytest.approx(up.scaling["default"])
    assert set(ad.saved) == {"lm_head.weight"}


def test_write_folder_peft_reads(tmp_path):
    torch.manual_seed(1)
    cfg = PeftLoraConfig(r=2, lora_alpha=4, target_modules=["v_proj"])
    lora = {f"model.layers.{i}.self_attn.v_proj": LoraPair(torch.randn(2, 32), torch.randn(16, 2), 2.0)
            for i in range(2)}
    write_adapter(tmp_path, PeftAdapter(cfg, lora))
    import peft

    pm = peft.PeftModel.from_pretrained(_hf_llama(), str(tmp_path))
    v = pm.base_model.model.model.layers[1].self_attn.v_proj
    assert torch.equal(v.lora_A["default"].weight, lora["model.layers.1.self_attn.v_proj"].A)
    assert torch.equal(v.lora_B["default"].weight, lora["model.layers.1.self_attn.v_proj"].B)
    assert v.scaling["default"] == 2.0
    assert read_adapter_config(tmp_path).target_modules == ["v_proj"]


def test_bad_folders(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_adapter(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="adapter_config.json is missing"):
        read_adapter(tmp_path)
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_adapter(tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3", "target_modules": ["q"]}))
    with pytest.raises(ValueError, match="not LORA"):
        read_adapter(tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4,
                                                              "target_modules": ["q"], "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora"):
        read_adapter(tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "target_modules": ["q"]}))
    (tmp_path / "adapter_model.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="pickle"):
        read_adapter(tmp_path)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="not a readable safetensors"):
        read_adapter(tmp_path)
