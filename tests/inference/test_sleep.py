"""``sleep`` / ``wake_up``: the KV cache memory really goes back, greedy outputs are the
same after waking, and sleep -> load_weights -> wake_up (the RLHF weight sync) works."""

from __future__ import annotations

import os

import pytest
import torch

from zeal.inference import LLM, EngineAsleepError, SamplingParams
from zeal.models import GPT, GPTConfig

pytestmark = pytest.mark.timeout(120)
CFG = GPTConfig(vocab_size=64, n_positions=64, n_embd=64, n_layer=2, n_head=2)
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = [list(range(1, 12)), [5, 9, 2, 7], list(range(20, 40))]


def _gpt(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG).eval()


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def _kv_bytes(llm: LLM) -> int:
    r = llm.engine.runner
    return sum(t.untyped_storage().nbytes() for t in (*r.k_cache, *r.v_cache))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_sleep_frees_the_kv_cache_and_wake_up_gives_the_same_outputs():
    # 4 tensors of 32 MiB (2 layers x K, V): glibc serves blocks this large with mmap, so
    # freeing them shows in the RSS at once
    llm = LLM(_gpt(0), block_size=16, kv_cache_bytes=128 << 20)
    kv = _kv_bytes(llm)
    assert kv == 128 << 20
    before = _tokens(llm)
    assert llm.engine.bm.cached  # prefixes are cached ...
    rss_awake = _rss()
    llm.sleep()
    assert llm.is_sleeping() and _kv_bytes(llm) == 0  # the engine holds no KV memory
    assert not llm.engine.bm.cached  # ... and forgotten by sleep
    if os.path.exists("/proc/self/statm"):
        assert rss_awake - _rss() >= 0.9 * kv, (rss_awake, _rss())
    with pytest.raises(EngineAsleepError, match="wake_up"):
        llm.generate(PROMPTS, GREEDY)
    with pytest.raises(RuntimeError, match="already asleep"):
        llm.sleep()
    llm.wake_up()
    assert not llm.is_sleeping() and _kv_bytes(llm) == kv
    assert _tokens(llm) == before
    llm.wake_up()  # awake: nothing to do


def test_sleep_is_refused_while_requests_run():
    llm = LLM(_gpt(0), block_size=4, num_blocks=64)
    llm.engine.add_request("r", PROMPTS[0], GREEDY)
    llm.engine.step()
    with pytest.raises(RuntimeError, match="1 unfinished request"):
        llm.sleep()
    llm.engine.abort("r")
    llm.sleep()
    with pytest.raises(ValueError, match="level"):
        LLM(_gpt(0), num_blocks=8).sleep(3)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_load_weights_wake_up(level):
    """The RLHF loop: generate, sleep while training, push the new weights, wake, generate."""
    llm = LLM(_gpt(0), block_size=4, num_blocks=64)
    old = _tokens(llm)
    fresh = _tokens(LLM(_gpt(1), block_size=4, num_blocks=64))
    assert fresh != old
    llm.sleep(level)
    if level == 2:  # the weights went too
        assert all(p.untyped_storage().nbytes() == 0 for p in llm.engine.runner.model.parameters())
    n = llm.load_weights(_gpt(1).state_dict().items())
    assert n > 0 and llm.is_sleeping() and _kv_bytes(llm) == 0
    llm.wake_up()
    assert _tokens(llm) == fresh


def test_level_2_without_new_weights_refuses_to_generate():
    llm = LLM(_gpt(0), block_size=4, num_blocks=64)
    llm.sleep(2)
    llm.wake_up()
    with pytest.raises(EngineAsleepError, match="load_weights"):
        llm.generate(PROMPTS, GREEDY)
    llm.load_weights(_gpt(0).state_dict().items())
    assert _tokens(llm) == _tokens(LLM(_gpt(0), block_size=4, num_blocks=64))
