"""Speculative decoding with a draft model: greedy outputs equal plain greedy decoding.

Reference: the same engine without ``speculative_config``. With the target as its own
draft every draft is accepted (acceptance 1.0); with a different random model most are
rejected and rolled back, and the output is still plain greedy's. Batches mix prompt
lengths (and one sampled request, which does not speculate), blocks are small so drafts
cross block boundaries, and one cache is small enough to preempt.
"""

from __future__ import annotations

import pytest
import torch

from tests.inference.conftest import mixed_prompts, stop_app
from zeal.config.inference import EngineConfig
from zeal.inference import LLM, SamplingParams
from zeal.models.hf import load_hf_model


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """A different random Llama (one layer, narrower) over the same 96-token vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      initializer_range=0.08, eos_token_id=1, bos_token_id=None, pad_token_id=None)
    path = tmp_path_factory.mktemp("draft")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return load_hf_model(path)[0].eval()


def _prompts() -> list[list[int]]:
    loop = [10, 11, 12, 13] * 5
    return [loop, [40, 41, 42]] + mixed_prompts(4, 3, 2, 30)


def _run(llama_dir, spec: dict | None, num_blocks: int = 64, max_tokens: int = 16):
    prompts = _prompts()
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=3, ignore_eos=True)
    params = [greedy] * len(prompts) + [sampled]
    kw = {"block_size": 4, "num_blocks": num_blocks, "max_num_batched_tokens": 64}
    llm = LLM(str(llama_dir), speculative_config=spec, **kw) if spec else LLM(str(llama_dir), **kw)
    outs = llm.generate(prompts + [prompts[0]], params)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.timeout(120)
def test_target_as_its_own_draft_accepts_every_draft(llama_dir):
    _, want = _run(llama_dir, None)
    spec = {"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": 3}
    llm, got = _run(llama_dir, spec)
    assert got == want
    m = llm.engine.metrics
    assert m.spec_draft_tokens_total > 0 and m.spec_accepted_tokens_total == m.spec_draft_tokens_total
    assert m.spec_acceptance_rate() == 1.0
    text = m.render({})
    assert f"zeal_spec_decode_num_draft_tokens_total {m.spec_draft_tokens_total}" in text
    assert f"zeal_spec_decode_num_accepted_tokens_total {m.spec_accepted_tokens_total}" in text
    assert llm.engine.bm.num_used_blocks == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("draft,num_blocks", [("random", 64), ("first_layer", 64), ("first_layer", 24)])
def test_different_draft_model_keeps_plain_greedy_output(llama_dir, other_draft, draft, num_blocks):
    """24 blocks of 4 for 7 sequences of up to 46 tokens: preempts."""
    from zeal.inference.draft_model import first_layers

    _, want = _run(llama_dir, None, num_blocks)
    model = other_draft if draft == "random" else first_layers(load_hf_model(llama_dir)[0], 1)
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 4}
    llm, got = _run(llama_dir, spec, num_blocks)
    assert got == want
    m = llm.engine.metrics
    assert m.spec_accepted_tokens_total < m.spec_draft_tokens_total  # rejected drafts rolled back
    if draft == "first_layer":
        assert m.spec_accepted_tokens_total > 0  # and accepted ones kept
    assert llm.engine.bm.num_used_blocks == 0
    if num_blocks == 24:
        assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.drafter.propose([], [])  # no sequence runs: every shadow is freed
    assert llm.engine.drafter.bm.num_used_blocks == 0


def test_draft_model_config_is_validated(llama_dir, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = EngineConfig(speculative_config='{"method": "draft_model", "model": "/m", "num_speculative_tokens": 2}')
    assert (cfg.speculative_config.method, cfg.speculative_config.model) == ("draft_model", "/m")
    with pytest.raises(ValueError, match="method 'draft_model' needs 'model'"):
        EngineConfig(speculative_config={"method": "draft_model"})
    with pytest.raises(ValueError, match="'model' is for method 'draft_model'"):
        EngineConfig(speculative_config={"method": "ngram", "model": "/m"})
    LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"vocabulary \(50 tokens\) differs from the target's \(96\)"):
        LLM(str(llama_dir), speculative_config={"method": "draft_model", "model": str(tmp_path)})


def test_serve_flag_draft_model(llama_dir):
    import argparse

    from zeal.cli.serve import add_arguments, build, config_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    spec = f'{{"method": "draft_model", "model": "{llama_dir}", "num_speculative_tokens": 2}}'
    cfg = config_from_args(p.parse_args([str(llama_dir), "--dtype", "float32", "--speculative-config", spec]))
    assert cfg.engine.speculative_config.model == str(llama_dir)
    app, _ = build(cfg)
    assert app is not None
    stop_app(app)
