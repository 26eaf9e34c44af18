"""Tensor-parallel serving of an MoE model: a Hugging Face Mixtral folder served at
``tensor_parallel_size=2`` (experts split column/row over the two ranks, the router whole,
routing without capacity dropping) gives the greedy tokens of one process, and the
chosen tokens' log-probabilities agree to fp32 rounding."""

from __future__ import annotations

import pytest
import torch

from tests.moe.test_mixtral import VOCAB, _mixtral


@pytest.mark.timeout(120)
def test_mixtral_tp2_equals_tp1(tmp_path, monkeypatch):
    from zeal.inference import LLM, SamplingParams

    _mixtral().save_pretrained(tmp_path)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (3, 9, 17, 5)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)
    kw = dict(block_size=4, num_blocks=128, max_num_batched_tokens=16)  # chunked prompts beside decodes
    one = LLM(str(tmp_path), **kw).generate(prompts, params)
    llm = LLM(str(tmp_path), tensor_parallel_size=2, **kw)
    try:
        split = {tuple(p.shape) for n, p in llm.engine.runner.model.named_parameters() if "experts" in n}
        assert split == {(24, 32), (32, 24)}  # intermediate 48 over 2 ranks: the experts are split
        two = llm.generate(prompts, params)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
    err = max(abs(a["logprob"] - b["logprob"]) for x, y in zip(one, two)
              for a, b in zip(x.outputs[0].logprobs, y.outputs[0].logprobs))
    assert err < 1e-4
