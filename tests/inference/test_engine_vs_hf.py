"""Greedy output of the engine equals transformers ``generate`` token for token."""

from __future__ import annotations

import pytest

from tests.inference.conftest import hf_greedy, mixed_prompts
from zeal.inference import LLM, SamplingParams

NEW = 12
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def case(request, llama_dir, gpt2_dir):
    path = llama_dir if request.param == "llama" else gpt2_dir
    prompts = mixed_prompts(1, 6, 1, 40)
    shared = mixed_prompts(2, 4, 3, 12, prefix=mixed_prompts(3, 1, 37, 37)[0])
    ref = hf_greedy(path, prompts + shared, NEW)
    return path, prompts, shared, ref[: len(prompts)], ref[len(prompts) :]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.timeout(60)
def test_mixed_batch_matches_hf(case, kernels):
    path, prompts, _, ref, _ = case
    llm = LLM(path, block_size=4, num_blocks=256, max_num_batched_tokens=512)
    assert (llm.engine.runner.kernels is None) == (kernels == "torch")
    assert _tokens(llm.generate(prompts, GREEDY)) == ref


@pytest.mark.timeout(60)
def test_chunked_prompts_match_hf(case, kernels):
    path, prompts, _, ref, _ = case
    llm = LLM(path, block_size=4, num_blocks=256, max_num_batched_tokens=7)
    assert _tokens(llm.generate(prompts, GREEDY)) == ref


@pytest.mark.timeout(60)
def test_prefix_cache_hits_match_hf(case, kernels):
    path, _, shared, _, ref = case
    llm = LLM(path, block_size=4, num_blocks=256, max_num_batched_tokens=64)
    first = llm.generate(shared[:1], GREEDY)  # fills the cache with the shared prefix
    rest = llm.generate(shared[1:], GREEDY)
    assert llm.engine.bm.num_prefix_hits >= 9 * 3
    assert _tokens(first + rest) == ref


@pytest.mark.timeout(60)
def test_preemption_matches_hf(case, kernels):
    path, prompts, _, ref, _ = case
    # 14 blocks of 4 tokens: the longest request (40 + 12 tokens) fits alone, the batch does not
    llm = LLM(path, block_size=4, num_blocks=14, max_num_batched_tokens=32, enable_prefix_caching=False)
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert _tokens(outs) == ref
    assert llm.engine.bm.num_free_blocks == 14


@pytest.mark.timeout(60)
def test_n_greater_than_one_shares_blocks_copy_on_write(case, kernels):
    path, prompts, _, ref, _ = case
    llm = LLM(path, block_size=4, num_blocks=256)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, n=3)
    outs = llm.generate(prompts[:3], params)
    for o, r in zip(outs, ref[:3]):
        assert [c.token_ids for c in o.outputs] == [r] * 3
    assert llm.engine.runner.num_block_copies > 0
    assert llm.engine.bm.num_free_blocks == 256
