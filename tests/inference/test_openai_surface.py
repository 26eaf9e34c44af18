"""The OpenAI fields clients read, validated by the OpenAI SDK's own pydantic types (not
``construct``): ``models.retrieve``, ``message.refusal``, ``usage: null`` on the chunks before
the usage chunk, legacy completions' ``logprobs`` with ``echo`` streamed and not."""

from __future__ import annotations

import json

import httpx
import pytest

from zeal.inference.async_engine import AsyncEngine
from zeal.inference.engine import EngineConfig, LLMEngine
from zeal.inference.llm import load_model_and_tokenizer
from zeal.inference.server import build_app

NAME = "org/tiny"  # a name with a slash, as Hugging Face ids are


@pytest.fixture(scope="module")
def base(llama_dir, serve_app):
    model, tok, eos = load_model_and_tokenizer(llama_dir)
    engine = LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=64), eos)
    with serve_app(build_app(AsyncEngine(engine), NAME)) as url:
        yield url


def _client(base):
    from openai import OpenAI

    return OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=30)


@pytest.mark.timeout(60)
def test_models_retrieve(base):
    from openai import NotFoundError
    from openai.types import Model

    m = _client(base).models.retrieve(NAME)
    assert Model.model_validate(m.model_dump()).id == NAME
    with pytest.raises(NotFoundError):
        _client(base).models.retrieve("other")


@pytest.mark.timeout(60)
def test_chat_refusal_null_and_usage_null_on_chunks(base):
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=30).json()
    assert r["choices"][0]["message"]["refusal"] is None
    ChatCompletion.model_validate(r)
    chunks = _sse(base + "/v1/chat/completions", body | {"stream": True, "stream_options": {"include_usage": True}})
    assert [c["usage"] is None for c in chunks] == [True] * (len(chunks) - 1) + [False]
    assert chunks[-1]["usage"]["completion_tokens"] == 4 and chunks[-1]["choices"] == []
    for c in chunks:
        ChatCompletionChunk.model_validate(c)


def _sse(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url, json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


@pytest.mark.timeout(60)
def test_completion_logprobs_validate_as_sdk_types(base):
    """Generated tokens' logprobs validate as the SDK's ``Completion``; streamed, they are the same. With
    ``echo`` the first prompt token's entries are null, as in OpenAI's and vLLM's answers (the
    SDK's type says ``List[float]``, stricter than the API it reads; it builds without validating)."""
    from openai.types import Completion

    kw = {"model": NAME, "prompt": "abc", "logprobs": 2, "max_tokens": 3, "temperature": 0,
          "extra_body": {"ignore_eos": True}}
    c = _client(base).completions.create(**kw)
    lp = Completion.model_validate(c.model_dump()).choices[0].logprobs
    assert len(lp.tokens) == 3 and lp.text_offset == [0, len(lp.tokens[0]), len(lp.tokens[0] + lp.tokens[1])]
    # streamed: the SDK's type (shared with non-streamed answers) says finish_reason is never null
    got = list(_client(base).completions.create(**kw, stream=True))
    assert sum((x.choices[0].logprobs.tokens for x in got), []) == lp.tokens
    assert sum((x.choices[0].logprobs.text_offset for x in got), []) == lp.text_offset
    e = _client(base).completions.create(**kw, echo=True).choices[0].logprobs
    assert e.token_logprobs[0] is None and e.top_logprobs[0] is None and e.text_offset[:3] == [0, 1, 2]
    assert e.tokens == ["a", "b", "c", *lp.tokens] and e.token_logprobs[3:] == lp.token_logprobs


@pytest.mark.timeout(60)
@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_logit_bias_is_refused_by_name_unless_empty(base, route):
    body = {"model": NAME, "max_tokens": 2, "temperature": 0}
    body |= {"prompt": "hi"} if route == "completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{base}/v1/{route}", json=body | {"logit_bias": {"5": 100}}, timeout=30)
    assert r.status_code == 400, r.text  # it was accepted and silently not applied
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "logit_bias" in err["message"] and "\n" not in err["message"]
    assert httpx.post(f"{base}/v1/{route}", json=body | {"logit_bias": {}}, timeout=30).status_code == 200
