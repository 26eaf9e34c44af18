"""Sampling rules: truncations, penalties, seeds, stops, logprobs."""

from __future__ import annotations

import pytest
import torch

from zeal.inference import LLM, SamplingParams
from zeal.inference.sampler import apply_penalties, draw, filter_logits, sample


def test_filters():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    keep = lambda p: (filter_logits(logits, p) > float("-inf")).tolist()  # noqa: E731
    assert keep(SamplingParams(top_k=2)) == [True, True, False, False]
    assert keep(SamplingParams(top_p=0.8)) == [True, True, False, False]
    assert keep(SamplingParams(top_p=0.81)) == [True, True, True, False]
    assert keep(SamplingParams(min_p=0.25)) == [True, True, True, False]
    assert keep(SamplingParams(top_p=0.01)) == [True, False, False, False]


def test_penalties():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.0])
    out = apply_penalties(logits, [0], [1, 1], SamplingParams(repetition_penalty=2.0))
    assert out.tolist() == [1.0, -4.0, 1.0, 0.0]
    out = apply_penalties(logits, [0], [1, 1, 2], SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
    assert out.tolist() == [2.0, -3.0, 0.25, 0.0]


def test_draw_follows_the_distribution():
    """Inverse-CDF draws: frequencies match the probabilities (within 5 sigma over
    20k draws), zero-probability tokens never come out, an edge token can."""
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.25, 0.05, 0.0])
    g = torch.Generator().manual_seed(0)
    n = 20_000
    counts = torch.bincount(torch.tensor([draw(probs, g) for _ in range(n)]), minlength=7).double()
    assert counts[probs == 0].sum() == 0
    sigma = (n * probs * (1 - probs)).sqrt()
    assert ((counts - n * probs).abs() <= 5 * sigma + 1e-9).all(), counts.tolist()
    assert draw(torch.tensor([0.0, 0.0, 1.0]), g) == 2
    assert draw(torch.tensor([1.0, 0.0, 0.0]), g) == 0


def test_seed_reproducible_and_greedy():
    logits = torch.randn(3, 50)
    p = SamplingParams(temperature=1.0)
    draw = lambda seed: [r.token for r in sample(logits, [([], [])] * 3, [p] * 3,  # noqa: E731
                                                 [torch.Generator().manual_seed(seed)] * 3)]
    assert draw(7) == draw(7)
    g = sample(logits, [([], [])] * 3, [SamplingParams(temperature=0)] * 3, [None] * 3)
    assert [r.token for r in g] == logits.argmax(-1).tolist()
    lp = sample(logits[:1], [([], [])], [SamplingParams(temperature=0, logprobs=3)], [None])[0]
    assert lp.logprob == pytest.approx(torch.log_softmax(logits[0], -1).max().item())
    assert len(lp.top_logprobs) == 3 and lp.token in lp.top_logprobs


@pytest.mark.timeout(60)
def test_stops_and_seeds_end_to_end(llama_dir):
    llm = LLM(llama_dir, block_size=4, num_blocks=128)
    p = SamplingParams(max_tokens=20, temperature=1.0, seed=11, ignore_eos=True)
    a, b = llm.generate(["hello", "hello"], p)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids  # same seed, same draw
    full = a.outputs[0].text
    stop = full[5:7]
    cut = llm.generate(["hello"], SamplingParams(max_tokens=20, temperature=1.0, seed=11, ignore_eos=True,
                                                 stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]
    tok = a.outputs[0].token_ids[3]
    by_id = llm.generate(["hello"], SamplingParams(max_tokens=20, temperature=1.0, seed=11, ignore_eos=True,
                                                   stop_token_ids=[tok]))[0].outputs[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids[-1] == tok
    assert len(by_id.token_ids) == a.outputs[0].token_ids.index(tok) + 1
    streamed = "".join(o.outputs[0].delta_text for o in llm.stream("hello", SamplingParams(
        max_tokens=20, temperature=1.0, seed=11, ignore_eos=True, stop=[stop])))
    assert streamed == cut.text
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="exceeds"):
        llm.generate(["x"], SamplingParams(max_tokens=10_000))
