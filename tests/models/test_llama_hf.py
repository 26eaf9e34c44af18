"""zeal's Llama and Hugging Face folders: export, load in ``transformers``, load back.

Tolerance: the same fp32 weights through the same per-layer arithmetic; attention
sums in another order (SDPA vs HF's eager matmuls), so logits agree to a few ulps
of their magnitude (~1e-6); 1e-5 leaves room for that only: a transposed weight, a
wrong RoPE layout or a lost tie moves logits by orders of magnitude more.
"""

from __future__ import annotations

import json

import pytest
import torch

from zeal.models.llama import Llama, LlamaConfig

transformers = pytest.importorskip("transformers")

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16}


def _model(tied: bool, scaling: dict | None) -> Llama:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tied, rope_theta=5000.0, rope_scaling=scaling, initializer_range=0.1)
    return Llama(cfg)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING], ids=["rope", "llama3-rope"])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, tied, scaling):
    model = _model(tied, scaling).eval()
    path = model.save_hf_folder(tmp_path / "export")
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert (hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()) == tied
    ids = torch.randint(0, 80, (2, 40), generator=torch.Generator().manual_seed(1))  # past 16: llama3 scaling bites
    with torch.no_grad():
        ours, theirs = model(ids), hf(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    # and back: the same module, bit for bit
    back = Llama.from_hf_folder(path)
    assert back.config.tie_word_embeddings == tied and back.config.rope_scaling == model.config.rope_scaling
    assert (back.lm_head.weight is back.model.embed_tokens.weight) == tied
    with torch.no_grad():
        assert torch.equal(back(ids), ours)


@pytest.mark.timeout(60)
def test_hf_folder_loads_into_zeal_llama_with_hf_logits(tmp_path):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False)).eval()
    hf.save_pretrained(tmp_path / "hf")
    model = Llama.from_hf_folder(tmp_path / "hf")
    ids = torch.randint(0, 80, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
        # the loss convention of zeal's models: labels are the inputs, shifted inside
        torch.testing.assert_close(model(ids, labels=ids), hf(input_ids=ids, labels=ids).loss, atol=1e-5, rtol=1e-5)


def test_export_refuses_what_it_cannot_write(tmp_path):
    from zeal.models import GPT, GPTConfig
    from zeal.models.hf import save_hf_folder

    with pytest.raises(TypeError, match="zeal checkpoint export"):
        save_hf_folder(GPT(GPTConfig(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2)), tmp_path / "x")
    with pytest.raises(ValueError, match="not a Llama"):
        from transformers import GPT2Config, GPT2LMHeadModel

        GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2)).save_pretrained(
            tmp_path / "gpt2")
        Llama.from_hf_folder(tmp_path / "gpt2")


def test_a_dense_models_config_json_has_no_moe_keys(tmp_path):
    """transformers reads a stray ``top_k`` as a generation flag and warns: a dense export
    carries only the keys its architecture has, and still round-trips."""
    from zeal.models.hf import load_hf_model, save_hf_folder
    from zeal.models.llama import _MOE_KEYS

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    out = save_hf_folder(Llama(cfg), tmp_path / "dense")
    written = json.loads((out / "config.json").read_text())
    assert not set(_MOE_KEYS) & set(written) and "qk_norm" not in written and "clip_qkv" not in written
    assert "top_k" in _MOE_KEYS and "num_experts" in _MOE_KEYS
    model, _ = load_hf_model(out)
    assert model.config.num_experts == 0 and model.config.hidden_size == 32
    moe = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, num_experts=4, top_k=2)
    assert moe.to_hf()["num_experts"] == 4 and moe.to_hf()["top_k"] == 2  # an MoE keeps them
