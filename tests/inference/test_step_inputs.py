"""The packed step inputs (one host-to-device transfer) equal the tensors the model runner
builds one at a time; the flex attention path they feed serves the same greedy tokens
and the same seeded samples as the CPU path (prefix hits, chunked prefill, n > 1)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from zeal.inference import LLM, SamplingParams
from zeal.inference.attention import DecodeTables
from zeal.inference.model_runner import ModelRunner, StepPlan
from zeal.inference.step_inputs import StepInputPacker

BS = 4


def _plans() -> list[StepPlan]:
    mixed = StepPlan(copies=[], ids=[5, 6, 7, 1, 2, 3, 4, 9], pos=[8, 3, 12, 0, 1, 2, 3, 5],
                     slots=[9, 14, 20, 40, 41, 42, 43, 61], sample_rows=[0, 1, 2, 6, 7],
                     dec_rows=[0, 1, 2], dec_tables=[[2, 3, 7], [3, 1], [5, 6, 4, 8]], dec_lens=[9, 4, 13],
                     prefills=[[3, 4, 4, [10, 11]], [7, 1, 6, [15, 12, 13]]])
    scattered = StepPlan(ids=[1, 2, 3], pos=[4, 0, 7], slots=[1, 2, 3], sample_rows=[0, 2],
                         dec_rows=[0, 2], dec_tables=[[1, 2], [3, 4]], dec_lens=[5, 8], prefills=[[1, 1, 1, [9]]])
    prefill_only = StepPlan(ids=[1, 2], pos=[0, 1], slots=[4, 5], sample_rows=[1], prefills=[[0, 2, 2, [1]]])
    return [mixed, scattered, prefill_only]


@pytest.mark.parametrize("which", [0, 1, 2])
def test_packed_inputs_equal_todays_tensors(which):
    plan = _plans()[which]
    ops = object()  # the fused-kernel path: decodes as DecodeTables
    ref = ModelRunner.prepare(SimpleNamespace(packer=None, block_size=BS, device=torch.device("cpu"), kernels=ops),
                              plan)
    packer = StepInputPacker(torch.device("cpu"), BS)
    got = packer.prepare(plan, ops)
    assert packer.transfers == 1
    for a, b in [(got[0], ref[0]), (got[1], ref[1]), (got[3], ref[3]), (got[2].slot_mapping, ref[2].slot_mapping)]:
        assert a.dtype == b.dtype and torch.equal(a, b)
    gm, rm = got[2], ref[2]
    assert gm.kernels is ops and len(gm.prefills) == len(rm.prefills)
    for g, r in zip(gm.prefills, rm.prefills):
        assert (g.q_start, g.q_len, g.ctx_len) == (r.q_start, r.q_len, r.ctx_len)
        assert g.block_table.dtype == r.block_table.dtype and torch.equal(g.block_table, r.block_table)
    assert (gm.decodes is None) == (rm.decodes is None)
    if rm.decodes is not None:
        assert isinstance(gm.decodes, DecodeTables)
        if isinstance(rm.decodes.rows, slice):
            assert gm.decodes.rows == rm.decodes.rows
        else:
            assert torch.equal(gm.decodes.rows, rm.decodes.rows)
        for name in ("block_tables", "ctx_lens"):
            a, b = getattr(gm.decodes, name), getattr(rm.decodes, name)
            assert a.dtype == b.dtype and torch.equal(a, b), name


def _generate(llama_dir, **kw):
    llm = LLM(llama_dir, block_size=BS, num_blocks=96, max_num_batched_tokens=12, **kw)
    base = [3, 9, 4, 12, 33, 8, 17, 20, 5, 6]
    prompts = [base, base + [7, 7], [40, 41], base[:6]]  # shared prefixes, chunked prompts
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=5, n=2, ignore_eos=True, logprobs=2)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    again = [o.outputs[0].token_ids for o in llm.generate(prompts[:2], greedy)]  # prefix-cache hits
    samp = llm.generate([base], seeded)[0].outputs
    return first, again, [(c.token_ids, [lp["logprob"] for lp in c.logprobs]) for c in samp], llm


@pytest.mark.timeout(120)
def test_flex_backend_serves_the_tokens_of_the_cpu_path(llama_dir, monkeypatch):
    ref = _generate(llama_dir)
    monkeypatch.setenv("ZEAL_ATTENTION_BACKEND", "flex")
    got = _generate(llama_dir)
    runner = got[3].engine.runner
    assert runner.attn_backend is not None and runner.packer.transfers > 0
    assert ref[3].engine.runner.packer is None
    assert got[0] == ref[0] and got[1] == ref[1] == ref[0][:2]
    for (gt, gl), (rt, rl) in zip(got[2], ref[2]):
        assert gt == rt
        assert gl == pytest.approx(rl, abs=1e-4)


def test_backend_env_is_checked(monkeypatch):
    from zeal.inference.paged_flex import attention_backend

    monkeypatch.setenv("ZEAL_ATTENTION_BACKEND", "fast")
    with pytest.raises(ValueError, match="ZEAL_ATTENTION_BACKEND"):
        attention_backend(torch.device("cpu"), torch.float32, torch.float32)
    monkeypatch.setenv("ZEAL_ATTENTION_BACKEND", "")
    assert attention_backend(torch.device("cpu"), torch.float32, torch.float32) is None
