"""Prompt scoring: ``SamplingParams.prompt_logprobs`` and ``/v1/completions`` with ``echo`` and
``logprobs`` give every prompt token's log-probability as a full-sequence ``log_softmax`` of
the model gives it (zeal's own dense forward to 1e-5 and transformers' to 1e-4, fp32), with
chunked prefill, a prefix-cache hit, preemption and ``n > 1``; and lm-evaluation-harness's
``local-completions`` requests (replayed as it sends them) get the right log-likelihoods."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from tests.inference.conftest import VOCAB, mixed_prompts
from zeal.inference import LLM, SamplingParams
from zeal.inference.async_engine import AsyncEngine
from zeal.inference.engine import EngineConfig, LLMEngine
from zeal.inference.llm import load_model_and_tokenizer
from zeal.inference.server import build_app

TOP = 3


def _params(**kw) -> SamplingParams:
    return SamplingParams(**({"max_tokens": 2, "temperature": 0.0, "ignore_eos": True, "prompt_logprobs": TOP}
                             | kw))


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def case(request, llama_dir, gpt2_dir):
    """``(folder, zeal's own model, HF model)``, both fp32."""
    from transformers import AutoModelForCausalLM

    path = llama_dir if request.param == "llama" else gpt2_dir
    own, _, _ = load_model_and_tokenizer(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, own.eval(), hf


def full_logprobs(model, ids: list[int], hf: bool = False) -> torch.Tensor:
    """``(len(ids) - 1, V)``: row ``j`` the log-softmax that scores ``ids[j + 1]`` (one dense pass)."""
    with torch.no_grad():
        out = model(torch.tensor([ids]))
        logits = out.logits if hf else out
    return torch.log_softmax(logits[0, :-1].float(), -1)


def check_against(entries: list[dict | None], ids: list[int], ref: torch.Tensor, tol: float) -> None:
    assert entries[0] is None and len(entries) == len(ids)
    got = torch.tensor([e["logprob"] for e in entries[1:]])
    want = ref.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert torch.allclose(got, want, atol=tol, rtol=0), (got - want).abs().max()
    for e, row in zip(entries[1:], ref):
        top = torch.topk(row, TOP)
        assert list(e["top_logprobs"]) == top.indices.tolist()
        assert torch.allclose(torch.tensor(list(e["top_logprobs"].values())), top.values, atol=tol, rtol=0)


def _check(case, outs, prompts) -> None:
    _, own, hf = case
    for o, p in zip(outs, prompts):
        assert o.prompt_token_ids == p
        check_against(o.prompt_logprobs, p, full_logprobs(own, p), 1e-5)
        check_against(o.prompt_logprobs, p, full_logprobs(hf, p, hf=True), 1e-4)


@pytest.mark.timeout(120)
def test_prompt_logprobs_match_full_sequence_log_softmax(case, kernels):
    path = case[0]
    prompts = mixed_prompts(5, 5, 2, 40)
    llm = LLM(path, block_size=4, num_blocks=256, max_num_batched_tokens=512)
    outs = llm.generate(prompts, _params())
    _check(case, outs, prompts)
    # a text prompt: scored over its own tokens
    text = "scoring the prompt"
    out = llm.generate([text], _params())[0]
    assert out.prompt_token_ids == llm.engine.tokenizer.encode(text)
    _check(case, [out], [out.prompt_token_ids])


@pytest.mark.timeout(120)
def test_chunked_prefill_prompt_logprobs(case, kernels):
    """Prompts longer than the token budget: each chunk's rows score its share of the prompt."""
    path = case[0]
    prompts = mixed_prompts(6, 3, 30, 60)
    llm = LLM(path, block_size=4, num_blocks=256, max_num_batched_tokens=7)
    _check(case, llm.generate(prompts, _params()), prompts)


@pytest.mark.timeout(120)
def test_prefix_cache_hit_keeps_prompt_logprobs(case):
    """A cached prefix is recomputed for a request that scores its prompt (a cached block keeps
    no logits); the blocks it computes still serve later requests' prefix hits."""
    path = case[0]
    prefix = mixed_prompts(7, 1, 24, 24)[0]
    first, second, third = mixed_prompts(8, 3, 5, 9, prefix=prefix)
    llm = LLM(path, block_size=4, num_blocks=256, max_num_batched_tokens=64)
    bm = llm.engine.bm
    llm.generate([first], _params(prompt_logprobs=None))  # caches the prefix's 6 blocks
    out = llm.generate([second], _params())[0]
    assert bm.num_prefix_hits == 0  # not reused: every position scored
    _check(case, [out], [second])
    llm.generate([third], _params(prompt_logprobs=None))
    assert bm.num_prefix_hits >= 6


@pytest.mark.timeout(120)
def test_preempted_and_forked_requests_keep_prompt_logprobs(case):
    path = case[0]
    prompts = mixed_prompts(9, 5, 20, 40)
    # 14 blocks of 4 tokens: the batch does not fit, requests are preempted and recomputed
    llm = LLM(path, block_size=4, num_blocks=14, max_num_batched_tokens=32, enable_prefix_caching=False)
    outs = llm.generate(prompts, _params(max_tokens=12))
    assert llm.engine.scheduler.num_preemptions > 0
    _check(case, outs, prompts)
    llm = LLM(path, block_size=4, num_blocks=256)
    outs = llm.generate(prompts[:2], _params(n=3, temperature=1.0, seed=0))
    assert all(len(o.outputs) == 3 for o in outs)
    _check(case, outs, prompts[:2])


def test_prompt_logprobs_output_once_then_final(llama_dir):
    """Streaming outputs carry the prompt's log-probs in the first output and the last only."""
    llm = LLM(llama_dir, block_size=4, num_blocks=64)
    outs = list(llm.stream(list(range(2, 12)), _params(max_tokens=4)))
    assert len(outs) == 4
    assert [o.prompt_logprobs is not None for o in outs] == [True, False, False, True]
    assert outs[0].prompt_logprobs == outs[-1].prompt_logprobs


# ------------------------------------------------------------ the HTTP route
@pytest.fixture(scope="module")
def server(llama_dir, serve_app):
    model, tok, eos = load_model_and_tokenizer(llama_dir)
    engine = LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=128, max_num_batched_tokens=16), eos)
    with serve_app(build_app(AsyncEngine(engine), "tiny")) as base:
        yield base, tok, model.eval()


def _post(base: str, body: dict) -> httpx.Response:
    return httpx.post(base + "/v1/completions", json={"model": "tiny"} | body, timeout=60)


@pytest.mark.timeout(120)
def test_echo_logprobs_over_prompt_and_completion(server):
    base, tok, model = server
    text = "the quick brown fox"
    r = _post(base, {"prompt": text, "echo": True, "logprobs": 2, "max_tokens": 3, "temperature": 0,
                     "ignore_eos": True})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    ids = tok.encode(text)
    lp = ch["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3 == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert ch["text"].startswith(text) and "".join(lp["tokens"]) == ch["text"]
    assert lp["text_offset"] == [len("".join(lp["tokens"][:k])) for k in range(len(lp["tokens"]))]
    gen = [tok.tok.token_to_id(t) for t in lp["tokens"][len(ids):]]
    ref = full_logprobs(model, ids + gen)
    want = ref.gather(1, torch.tensor(ids[1:] + gen)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(lp["token_logprobs"][1:]), want, atol=1e-5, rtol=0)
    assert all(len(t) == 2 for t in lp["top_logprobs"][1:])
    assert r.json()["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 3, "total_tokens": len(ids) + 3}


@pytest.mark.timeout(120)
def test_max_tokens_zero_with_echo_scores_the_prompt_only(server):
    base, tok, model = server
    ids = mixed_prompts(10, 1, 30, 30)[0]  # longer than the 16-token budget: chunked prefill
    r = _post(base, {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    ch = body["choices"][0]
    assert ch["text"] == tok.decode(ids, skip_special_tokens=False) and ch["finish_reason"] == "length"
    lp = ch["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) and lp["token_logprobs"][0] is None
    want = full_logprobs(model, ids).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(lp["token_logprobs"][1:]), want, atol=1e-5, rtol=0)
    assert body["usage"]["completion_tokens"] == 0
    # without echo there is nothing to return: refused as vLLM does
    r = _post(base, {"prompt": ids, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


@pytest.mark.timeout(60)
def test_suffix_refused(server):
    r = _post(server[0], {"prompt": "a", "suffix": "b"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"


def _stream(base: str, body: dict) -> list[dict]:
    with httpx.stream("POST", base + "/v1/completions", json={"model": "tiny", "stream": True} | body,
                      timeout=60) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


@pytest.mark.timeout(120)
def test_streamed_logprobs_equal_non_streamed(server):
    """Batched prompts and ``n``: the streamed chunks of each choice, joined, are the whole answer."""
    base = server[0]
    body = {"prompt": [[5, 6, 7, 8, 9], [40, 41, 42]], "n": 2, "echo": True, "logprobs": 1, "max_tokens": 5,
            "temperature": 0, "ignore_eos": True}
    whole = _post(base, body).json()
    chunks = _stream(base, body | {"stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == whole["usage"]
    joined: dict[int, dict] = {}
    for c in chunks[:-1]:
        (ch,) = c["choices"]
        j = joined.setdefault(ch["index"], {"text": "", "logprobs": {k: [] for k in ch["logprobs"]}})
        j["text"] += ch["text"]
        for k, v in ch["logprobs"].items():
            j["logprobs"][k] += v
        j["finish_reason"] = ch["finish_reason"]
    assert sorted(joined) == [0, 1, 2, 3]
    for ch in whole["choices"]:
        assert joined[ch["index"]] == {k: ch[k] for k in ("text", "logprobs", "finish_reason")}


# ------------------------------------------------------------ lm-evaluation-harness, replayed
def harness_loglikelihoods(resp: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """What lm-eval 0.4's ``LocalCompletionsAPI.parse_logprobs`` reads from an answer: per choice
    (by index), the sum of ``token_logprobs[ctxlen:-1]`` and whether each of those equals the
    best of its ``top_logprobs`` (its own reading, re-stated here as the contract to meet)."""
    res = []
    for choice, ctxlen in zip(sorted(resp["choices"], key=lambda c: c["index"]), ctxlens):
        lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        res.append((sum(lps), all(lp == max(t.values()) for lp, t in zip(lps, tops))))
    return res


@pytest.mark.timeout(120)
def test_lm_eval_local_completions_requests(server, llama_dir):
    """lm-eval's loglikelihood request: a batch of token-id prompts (context + continuation),
    ``echo: true, logprobs: 1, max_tokens: 1, temperature: 0, seed``; the log-likelihood of each
    continuation and its greedy flag are those of transformers' model."""
    from transformers import AutoModelForCausalLM

    base = server[0]
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(11)
    ctx = [torch.randint(2, VOCAB, (int(n),), generator=g).tolist() for n in (9, 20, 33)]
    conts = [[4, 5], [7], [9, 3, 12]]
    pairs = [(c, k) for c in ctx for k in conts]
    ref = full_logprobs(hf, ctx[1] + [0], hf=True)  # a greedy continuation of ctx[1]: its argmax
    pairs.append((ctx[1], [int(ref[-1].argmax())]))
    payload = {"model": "tiny", "prompt": [c + k for c, k in pairs], "temperature": 0, "max_tokens": 1,
               "logprobs": 1, "seed": 1234, "echo": True}
    resp = _post(base, payload).json()
    got = harness_loglikelihoods(resp, [len(c) for c, _ in pairs])
    for (c, k), (ll, greedy) in zip(pairs, got):
        ref = full_logprobs(hf, c + k, hf=True)[len(c) - 1 :]
        want = float(ref.gather(1, torch.tensor(k)[:, None]).sum())
        assert ll == pytest.approx(want, abs=1e-4)
        assert greedy == (ref.argmax(-1).tolist() == k)
    assert got[-1][1]  # the argmax continuation is greedy
    # lm-eval's max_tokens 0 variant: the same scores (no generated token to drop: one less entry)
    resp0 = _post(base, payload | {"max_tokens": 0}).json()
    for a, b in zip(resp["choices"], resp0["choices"]):
        assert a["logprobs"]["token_logprobs"][:-1] == b["logprobs"]["token_logprobs"]
