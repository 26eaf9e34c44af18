"""Block manager and scheduler invariants under random workloads (hypothesis)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zeal.inference import SamplingParams
from zeal.inference.block_manager import BlockManager, blocks_for
from zeal.inference.engine import EngineConfig, LLMEngine
from zeal.inference.sequence import Sequence
from zeal.models.llama import Llama, LlamaConfig

VOCAB = 4  # a tiny vocabulary makes shared prefixes (cache hits) frequent


def _tiny_model() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=VOCAB, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)).eval()


MODEL = _tiny_model()


def check_blocks(engine: LLMEngine) -> None:
    bm = engine.bm
    refs = Counter(b for s in engine.scheduler.running for b in s.block_table)
    for s in engine.scheduler.waiting:
        assert not s.block_table, "a waiting sequence holds blocks"
    for b in range(bm.num_blocks):
        assert bm.ref_count[b] == refs.get(b, 0), f"block {b}: ref {bm.ref_count[b]} != {refs.get(b, 0)} tables"
        assert bm.is_free(b) == (bm.ref_count[b] == 0)
    assert bm.num_free_blocks == sum(1 for b in range(bm.num_blocks) if bm.ref_count[b] == 0)
    for s in engine.scheduler.running:
        assert len(s.block_table) >= blocks_for(s.num_computed, bm.block_size)
    for h, b in bm.cached.items():
        assert bm.block_hash[b] == h


requests = st.lists(
    st.tuples(
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30),  # prompt
        st.integers(1, 8),  # max_tokens
        st.integers(1, 3),  # n
        st.booleans(),  # abort it midway
    ),
    min_size=1, max_size=8,
)


@pytest.mark.timeout(120)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=requests, block_size=st.integers(1, 6), spare=st.integers(0, 12), budget=st.integers(1, 24),
       max_seqs=st.integers(1, 6), caching=st.booleans(), seed=st.integers(0, 100))
def test_engine_invariants_random_workload(reqs, block_size, spare, budget, max_seqs, caching, seed):
    longest = max(len(p) + m for p, m, _, _ in reqs)
    num_blocks = blocks_for(longest, block_size) + spare  # the longest request fits alone, maybe no more
    engine = LLMEngine(MODEL, None, EngineConfig(block_size=block_size, num_blocks=num_blocks,
                                                 max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                                 enable_prefix_caching=caching))
    for i, (prompt, max_tokens, n, _) in enumerate(reqs):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, n=n, temperature=1.0,
                                                          seed=seed + i, ignore_eos=True))
    finished, steps = {}, 0
    while engine.has_unfinished():
        steps += 1
        assert steps < 2000, "the engine does not make progress"
        outs = engine.step()
        st_ = engine.last_stats
        assert st_.num_tokens <= budget and st_.num_seqs <= max_seqs
        assert st_.num_decode_tokens + st_.num_prompt_tokens == st_.num_tokens
        assert st_.num_decode_tokens <= st_.num_seqs
        check_blocks(engine)
        for o in outs:
            if o.finished:
                finished[o.request_id] = o
        if steps == 3:
            for i, (_, _, _, abort) in enumerate(reqs):
                if abort and str(i) not in finished:
                    engine.abort(str(i))
                    finished[str(i)] = None
                    check_blocks(engine)
    assert set(finished) == {str(i) for i in range(len(reqs))}
    for i, (_, max_tokens, n, _) in enumerate(reqs):
        o = finished[str(i)]
        if o is not None:
            assert not o.error
            assert [len(c.token_ids) for c in o.outputs] == [max_tokens] * n
    assert engine.bm.num_free_blocks == num_blocks, "blocks leaked"
    assert not engine.requests


@pytest.mark.timeout(60)
@settings(max_examples=30, deadline=None)
@given(reqs=requests, budget=st.integers(1, 40))
def test_scheduler_decode_first_and_one_split(reqs, budget):
    engine = LLMEngine(MODEL, None, EngineConfig(block_size=4, num_blocks=400, max_num_batched_tokens=budget))
    for i, (prompt, max_tokens, n, _) in enumerate(reqs):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, n=n, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        sched = engine.scheduler.schedule()
        kinds = [c.seq.is_decoding for c in sched.chunks]
        assert kinds == sorted(kinds, reverse=True), "a prompt chunk came before a decode token"
        assert sum(not c.sample for c in sched.chunks) <= 1, "more than one prompt split in a pass"
        assert sched.num_tokens <= budget
        logits = engine.runner.execute(sched)
        for c in sched.chunks:
            c.seq.num_computed += c.num_tokens
            engine.bm.commit(c.seq)
        sampled = [c.seq for c in sched.chunks if c.sample]
        assert logits.shape[0] == len(sampled)
        for s in sampled:
            if s.pending_fork:
                s.pending_fork = False
                s.params.n = 1  # keep this test to the scheduler: no siblings
            s.output_ids.append(0)
            if len(s.output_ids) >= s.params.max_tokens:
                engine.scheduler.finish(s, "length")
    assert engine.bm.num_free_blocks == 400


def test_block_manager_prefix_hits_and_copy_on_write():
    bm = BlockManager(num_blocks=8, block_size=2)
    p = SamplingParams()
    a = Sequence(0, "a", [1, 2, 3, 4, 5], p)
    bm.allocate(a)
    assert a.block_table == [0, 1, 2] and a.num_computed == 0
    a.num_computed = 5
    bm.commit(a)  # blocks 0 and 1 are full: cached
    b = Sequence(1, "b", [1, 2, 3, 4, 9], p)
    assert bm.allocate(b) == 4 and b.block_table[:2] == [0, 1]
    assert bm.ref_count[0] == bm.ref_count[1] == 2
    c = Sequence(2, "a", [1, 2, 3, 4, 5], p)
    bm.fork(a, c)
    c.output_ids.append(7)  # the next token goes to slot 5, in shared block 2: copy it
    assert bm.append_slot(c) == (2, c.block_table[2]) and c.block_table[2] != 2
    assert bm.ref_count[2] == 1
    for s in (a, b, c):
        bm.free_seq(s)
    assert bm.num_free_blocks == 8 and not any(bm.ref_count)
    d = Sequence(3, "d", [1, 2, 3, 4, 6, 6], p)  # cached blocks survive their owners
    assert bm.allocate(d) == 4


def test_block_manager_hands_out_low_ids_and_evicts_cached_last():
    """Blocks without cached content go out lowest id first (the blocks in use stay
    packed for decode attention); blocks with a prefix hash only when none is left."""
    bm = BlockManager(num_blocks=6, block_size=2)
    p = SamplingParams()
    a, b = Sequence(0, "a", [1, 2, 3], p), Sequence(1, "b", [4, 5, 6], p)
    bm.allocate(a)
    bm.allocate(b)
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    a.num_computed = 3
    bm.commit(a)  # block 0 is full: it keeps its hash when freed
    bm.free_seq(a)
    c = Sequence(2, "c", [7, 8, 9], p)
    bm.allocate(c)
    assert c.block_table == [1, 4]  # the free block without a hash (1), then the next lowest (4)
    d = Sequence(3, "d", [9, 9, 9], p)
    bm.allocate(d)
    assert d.block_table == [5, 0]  # the cached block 0 is evicted last
    assert 0 not in bm.block_hash and not bm.cached


def test_reset_prefix_cache_then_eviction_does_not_raise():
    """Regression: ``LLMEngine.load_weights`` cleared ``cached`` and ``block_hash`` but
    not ``free_cached``, so the next eviction of a free hashed block raised KeyError."""
    bm = BlockManager(num_blocks=3, block_size=2)
    p = SamplingParams()
    a = Sequence(0, "a", [1, 2, 3, 4, 5], p)
    bm.allocate(a)
    a.num_computed = 5
    bm.commit(a)
    bm.free_seq(a)
    assert len(bm.free_cached) == 2
    bm.reset_prefix_cache()
    assert bm.num_free_blocks == 3 and not bm.free_cached and not bm.cached
    b = Sequence(1, "b", [1, 2, 3, 4, 5, 6], p)  # needs every block: nothing is reused
    assert bm.allocate(b) == 0 and sorted(b.block_table) == [0, 1, 2]


def test_a_sequence_running_across_a_reset_caches_nothing():
    """Its KV was computed partly with the old weights."""
    bm = BlockManager(num_blocks=6, block_size=2)
    p = SamplingParams()
    a = Sequence(0, "a", [1, 2, 3, 4, 5], p)
    bm.allocate(a)
    bm.reset_prefix_cache()
    a.num_computed = 5
    bm.commit(a)
    assert not bm.cached
    b = Sequence(1, "b", [1, 2, 3, 4, 5], p)
    assert bm.allocate(b) == 0
    b.num_computed = 5
    bm.commit(b)
    assert len(bm.cached) == 2


@pytest.mark.timeout(120)
def test_engine_load_weights_then_prefix_eviction():
    """The same through the engine: a cached prefix, new weights, then enough requests to evict."""
    from zeal.models import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    llm = LLMEngine(GPT(cfg).eval(), None, EngineConfig(num_blocks=6, block_size=4))
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    def run(prompts):
        for i, prompt in enumerate(prompts):
            llm.add_request(f"{len(llm.requests)}-{i}-{prompt[0]}", prompt, sp)
        done = []
        for _ in range(200):
            done += [o for o in llm.step() if o.finished]
            if not llm.has_unfinished():
                return done
        raise AssertionError("the engine does not make progress")

    run([list(range(1, 13))])  # 3 full blocks stay cached once the request ends
    torch.manual_seed(1)
    llm.load_weights(GPT(cfg).state_dict().items())
    outs = run([list(range(20, 40))])  # needs every block: evicts what was cached
    assert len(outs) == 1 and len(outs[0].outputs[0].token_ids) == 2
