"""A Hugging Face Mixtral built from a tiny config loads as a zeal Llama with MoE MLPs:
logits equal HF's (per-expert and fused expert layouts), and the serving engine's greedy
tokens (``zeal serve``'s LLM, routing without capacity dropping) equal HF ``generate``."""

from __future__ import annotations

import pytest
import torch

VOCAB = 64


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=128, initializer_range=0.1, eos_token_id=1, bos_token_id=None,
                        pad_token_id=None)
    return MixtralForCausalLM(cfg).eval()


@pytest.mark.timeout(120)
def test_mixtral_logits_and_serving_equal_hf(tmp_path, monkeypatch):
    from zeal.inference import LLM, SamplingParams
    from zeal.models.hf import load_hf_model
    from zeal.models.hf_moe import mixtral_config, mixtral_state_from_hf
    from zeal.models.llama import Llama

    hf = _mixtral()
    hf.save_pretrained(tmp_path)  # per-expert w1/w2/w3 on disk
    x = torch.randint(0, VOCAB, (2, 11))
    with torch.no_grad():
        ref = hf(x).logits
        model, _ = load_hf_model(tmp_path)
        torch.testing.assert_close(model(x), ref, rtol=1e-4, atol=1e-5)
        fused = Llama(mixtral_config(hf.config.to_dict())).eval()  # transformers 5 keeps experts fused
        fused.load_state_dict(mixtral_state_from_hf(hf.state_dict()), strict=True)
        torch.testing.assert_close(fused(x), ref, rtol=1e-4, atol=1e-5)

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (3, 9, 17, 5)]
    ref_tokens = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
            ref_tokens.append(out[0, len(p):].tolist())
    # the pure-torch serving path (tests/inference covers the fused kernels; no build here)
    monkeypatch.setattr("zeal.inference.model_runner.cpu_kernels", lambda: None)
    llm = LLM(str(tmp_path), block_size=4, num_blocks=128, max_num_batched_tokens=64)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == ref_tokens
