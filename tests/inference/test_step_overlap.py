"""Async scheduling (zeal.inference.step_overlap) against synchronous steps on CPU: the same
tokens, texts, stops and per-request streams (greedy and seeded sampling; stop tokens, stop
strings, max_tokens, an abort mid-stream), outputs one step behind with the decode rows'
ids read on the device, the steps that need the host run synchronously, and the refusals."""

from __future__ import annotations

import pytest
import torch

from zeal.inference import LLM, SamplingParams
from zeal.inference.cuda_graphs import FakeGraph
from zeal.inference.step_overlap import PLACEHOLDER

PROMPTS = [[3, 9, 4, 12, 33, 8], [40, 41], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [2], [7, 7, 7, 50, 51]]


def _params(stop: str | None = None, stop_id: int | None = None) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=9, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True),
            SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=14, temperature=1.0, top_k=20, seed=11, stop=[stop] if stop else []),
            SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_id] if stop_id is not None else [])]


def _stopping_params(llama_dir) -> list[SamplingParams]:
    """The requests with a stop string and a stop token each met mid-stream (taken from a run without)."""
    free = LLM(llama_dir, block_size=4, num_blocks=96).generate(PROMPTS, _params())
    return _params(stop=free[3].outputs[0].text[5:7], stop_id=free[4].outputs[0].token_ids[4])


def _run(llm: LLM, params: list[SamplingParams], abort_after: dict[int, int] | None = None) -> dict:
    """Every request's stream (delta ids, delta text, finish) and final output, driving the engine."""
    eng = llm.engine
    for i, (p, sp) in enumerate(zip(PROMPTS, params)):
        eng.add_request(f"r{i}", p, sp)
    streams: dict[str, list] = {f"r{i}": [] for i in range(len(PROMPTS))}
    final = {}
    while eng.has_unfinished():
        for out in eng.step():
            c = out.outputs[0]
            streams[out.request_id].append((list(c.delta_token_ids), c.delta_text, c.finish_reason))
            if out.finished:
                final[out.request_id] = (list(c.token_ids), c.text, c.finish_reason)
        for i, n in (abort_after or {}).items():
            rid = f"r{i}"
            if rid not in final and sum(len(d) for d, _, _ in streams[rid]) >= n:
                eng.abort(rid)
                final[rid] = "aborted"
    assert eng.bm.num_used_blocks == 0  # every block back, the discarded rows' included
    return {"streams": streams, "final": final}


@pytest.mark.timeout(120)
def test_async_scheduling_gives_the_synchronous_tokens_stops_and_streams(llama_dir):
    params = _stopping_params(llama_dir)
    ref = _run(LLM(llama_dir, block_size=4, num_blocks=96), params, abort_after={0: 4})
    llm = LLM(llama_dir, block_size=4, num_blocks=96, async_scheduling=True)
    got = _run(llm, params, abort_after={0: 4})
    assert got == ref
    assert ref["final"]["r0"] == "aborted" and sum(len(d) for d, _, _ in ref["streams"]["r0"]) == 4
    assert [ref["final"][f"r{i}"][2] for i in range(1, 5)] == ["length", "length", "stop", "stop"]
    st = llm.engine.overlap.stats
    assert st["overlapped"] > 10 and st["sync"] == 0 and st["discarded"] >= 1, st
    assert LLM(llama_dir, block_size=4, num_blocks=96).engine.overlap is None  # CPU: off unless asked


@pytest.mark.timeout(120)
def test_one_step_behind_with_the_ids_read_on_the_device(llama_dir):
    """Step 1 launches the prefill and emits nothing; step 2 launches the decodes, their ids read
    from step 1's sampled ids by a row map, and emits step 1's tokens; a request that its
    max_tokens ends with the token in flight is held out of the next step."""
    llm = LLM(llama_dir, block_size=4, num_blocks=96, async_scheduling=True)
    eng, runner = llm.engine, llm.engine.runner
    plans = []
    real_run = runner.run
    runner.run = lambda plan: plans.append(plan) or real_run(plan)
    eng.add_request("a", PROMPTS[0], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    eng.add_request("b", PROMPTS[1], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    assert eng.step() == []
    seqs = {r: eng.requests[r].seqs[0] for r in "ab"}
    assert all(s.output_ids == [PLACEHOLDER] for s in seqs.values())
    assert eng.overlap.pending is not None and eng.overlap.pending.rows == [0, 1]
    outs = {o.request_id: o for o in eng.step()}
    assert set(outs) == {"a", "b"} and outs["b"].finished and not outs["a"].finished
    assert len(outs["a"].outputs[0].token_ids) == 1 and PLACEHOLDER not in outs["a"].outputs[0].token_ids
    assert plans[1].fill_rows == [0] and plans[1].fill_src == [0] and len(plans[1].ids) == 1  # b held out
    assert seqs["a"].output_ids[-1] == PLACEHOLDER  # step 2's token in flight
    while eng.has_unfinished():
        eng.step()
    ref = LLM(llama_dir, block_size=4, num_blocks=96).generate(
        PROMPTS[:2], [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                      SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)])
    assert seqs["a"].output_ids == ref[0].outputs[0].token_ids and seqs["b"].output_ids == ref[1].outputs[0].token_ids
    assert len(plans) == 4  # prefill, then 3 decodes of a


@pytest.mark.timeout(120)
def test_host_features_run_synchronously_with_the_same_results(llama_dir):
    params = _stopping_params(llama_dir)
    params[2] = SamplingParams(max_tokens=5, temperature=0, logprobs=2, ignore_eos=True)
    ref = _run(LLM(llama_dir, block_size=4, num_blocks=96), params)
    llm = LLM(llama_dir, block_size=4, num_blocks=96, async_scheduling=True)
    assert _run(llm, params) == ref
    st = llm.engine.overlap.stats
    assert st["sync"] >= 1 and st["overlapped"] >= 1, st  # overlapped again once the logprobs request ended


@pytest.mark.timeout(120)
def test_async_scheduling_through_packed_inputs_decode_graphs_and_a_padded_single_row(llama_dir, monkeypatch):
    """The accelerator's path on CPU (flex attention, one packed transfer, decode graphs with a
    fake graph): the row map travels in the packed buffer; bf16 on CPU feeds one row twice."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    monkeypatch.setenv("ZEAL_ATTENTION_BACKEND", "flex")
    ref = [o.outputs[0].token_ids for o in LLM(llama_dir, block_size=4, num_blocks=96).generate(PROMPTS[:3], params)]
    llm = LLM(llama_dir, block_size=4, num_blocks=96, async_scheduling=True)
    llm.engine.runner.enable_decode_graphs(8, llm.engine.max_seq_tokens, graph_factory=FakeGraph)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], params)] == ref
    assert llm.engine.runner.graphs.stats["replay"] >= 3
    monkeypatch.delenv("ZEAL_ATTENTION_BACKEND")
    one = [PROMPTS[0]]
    ref = LLM(llama_dir, dtype=torch.bfloat16, block_size=4, num_blocks=96).generate(one, params)
    got = LLM(llama_dir, dtype=torch.bfloat16, block_size=4, num_blocks=96, async_scheduling=True).generate(one, params)
    assert got[0].outputs[0].token_ids == ref[0].outputs[0].token_ids


def test_refusals(llama_dir):
    with pytest.raises(ValueError, match="async_scheduling is not supported with speculative decoding"):
        LLM(llama_dir, block_size=4, num_blocks=96, async_scheduling=True,
            speculative_config={"method": "ngram"})


@pytest.mark.timeout(120)
def test_async_scheduling_under_preemption(llama_dir):
    """A cache too small for every request: sequences are preempted (some with their token in
    flight, recomputed from a prompt whose last id is read on the device) and the tokens stay."""
    params = [SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)] * 3 + _params()[3:]
    ref_llm = LLM(llama_dir, block_size=4, num_blocks=14)
    ref = _run(ref_llm, params)
    llm = LLM(llama_dir, block_size=4, num_blocks=14, async_scheduling=True)
    assert _run(llm, params) == ref
    assert ref_llm.engine.scheduler.num_preemptions > 0 and llm.engine.scheduler.num_preemptions > 0


def test_a_recomputed_prompt_reads_its_last_id_on_the_device(llama_dir):
    """A sequence preempted with its token in flight and recomputed in the next pass: the
    prompt chunk's last row takes the in-flight id from the device; the logits are those of
    the same chunk fed the real id."""
    from zeal.inference.sequence import ScheduledChunk, SchedulerOutput, Sequence

    runner = LLM(llama_dir, block_size=4, num_blocks=96).engine.runner

    def chunk(last: int) -> SchedulerOutput:
        seq = Sequence(7, "x", [5, 6, 7, 8, 9], SamplingParams(), output_ids=[30, last], block_table=[3, 4])
        return SchedulerOutput(chunks=[ScheduledChunk(seq, 0, 7, True)])

    want = runner.execute(chunk(44))
    runner.prev_tokens, runner.prev_rows = torch.tensor([11, 22, 44]), {7: 2}
    plan = runner.plan(chunk(PLACEHOLDER))
    assert plan.fill_rows == [6] and plan.fill_src == [2] and plan.ids[6] == 0 and not plan.dec_rows
    assert torch.equal(runner.execute(chunk(PLACEHOLDER)), want)


def test_abort_with_a_step_in_flight_then_sleep(llama_dir):
    llm = LLM(llama_dir, block_size=4, num_blocks=96, async_scheduling=True)
    eng = llm.engine
    eng.add_request("a", PROMPTS[0], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.overlap.pending is not None
    eng.abort("a")
    assert eng.has_unfinished()  # the step in flight, whose id is dropped when read
    llm.sleep(1)
    assert eng.overlap.pending is None and not eng.has_unfinished() and eng.bm.num_used_blocks == 0
    llm.wake_up()
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    ref = LLM(llama_dir, block_size=4, num_blocks=96).generate([PROMPTS[1]], params)
    assert llm.generate([PROMPTS[1]], params)[0].outputs[0].token_ids == ref[0].outputs[0].token_ids


def test_a_failing_batched_sampler_falls_back_row_by_row(llama_dir, monkeypatch):
    params = _stopping_params(llama_dir)
    ref = _run(LLM(llama_dir, block_size=4, num_blocks=96), params)

    def broken(*a, **k):
        raise RuntimeError("batched sampling failed")

    monkeypatch.setattr("zeal.inference.step_overlap.sample_tokens", broken)
    assert _run(LLM(llama_dir, block_size=4, num_blocks=96, async_scheduling=True), params) == ref
