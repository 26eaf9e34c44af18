"""The HTTP server on 127.0.0.1: the official openai client, malformed requests, aborts."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from zeal.inference.async_engine import AsyncEngine
from zeal.inference.engine import EngineConfig, LLMEngine
from zeal.inference.llm import load_model_and_tokenizer
from zeal.inference.server import ServerLimits, build_app

KEY = "sk-test"


def _engine(path) -> LLMEngine:
    model, tok, eos = load_model_and_tokenizer(path)
    return LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=128, max_num_batched_tokens=64), eos)


@pytest.fixture(scope="module")
def server(llama_dir, serve_app):
    aengine = AsyncEngine(_engine(llama_dir), max_waiting=64)
    app = build_app(aengine, "tiny", api_key=KEY, limits=ServerLimits(max_body_bytes=4096))
    with serve_app(app) as base:
        yield base, aengine


def _client(base):
    from openai import OpenAI

    return OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=30)


@pytest.mark.timeout(60)
def test_openai_client_completions_and_chat(server):
    base, _ = server
    c = _client(base)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    r = c.completions.create(model="tiny", prompt="hello", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    assert len(r.choices[0].text) == 5  # one character per token
    r2 = c.completions.create(model="tiny", prompt=["ab", "cd"], max_tokens=3, n=2, temperature=1.0, seed=3)
    assert sorted(ch.index for ch in r2.choices) == [0, 1, 2, 3]
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant" and len(chat.choices[0].message.content) == 4
    lp = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                   logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    assert len(lp.choices[0].logprobs.content) == 2 and len(lp.choices[0].logprobs.content[0].top_logprobs) == 3


@pytest.mark.timeout(60)
def test_openai_client_streaming_equals_non_streaming(server):
    base, _ = server
    c = _client(base)
    kw = dict(model="tiny", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    full = c.chat.completions.create(messages=[{"role": "user", "content": "abc"}], **kw).choices[0].message.content
    chunks = list(c.chat.completions.create(messages=[{"role": "user", "content": "abc"}], stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == full
    assert chunks[-1].choices[0].finish_reason == "length"
    text = "".join(ch.choices[0].text for ch in c.completions.create(prompt="xyz", stream=True, **kw))
    assert text == c.completions.create(prompt="xyz", **kw).choices[0].text


@pytest.mark.timeout(60)
def test_malformed_requests_get_4xx(server):
    base, _ = server
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    cases = [
        ("/v1/completions", b"{not json", 400),
        ("/v1/completions", b"[1, 2]", 400),
        ("/v1/completions", json.dumps({"max_tokens": 3}).encode(), 400),  # no prompt
        ("/v1/completions", json.dumps({"prompt": "a", "max_tokens": "lots"}).encode(), 400),
        ("/v1/completions", json.dumps({"prompt": "a", "temperature": "hot"}).encode(), 400),
        ("/v1/completions", json.dumps({"prompt": "a", "max_tokens": 10**9}).encode(), 400),
        ("/v1/completions", json.dumps({"prompt": "a", "n": 1000}).encode(), 400),
        ("/v1/completions", json.dumps({"prompt": "a" * 300}).encode(), 400),  # longer than the context
        ("/v1/completions", json.dumps({"prompt": [10**6]}).encode(), 400),  # token id out of range
        ("/v1/completions", json.dumps({"prompt": "a", "model": "other"}).encode(), 404),
        ("/v1/completions", json.dumps({"prompt": "a" * 5000}).encode(), 413),
        ("/v1/chat/completions", json.dumps({"messages": []}).encode(), 400),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), 400),
        ("/v1/chat/completions", json.dumps({"messages": "hi"}).encode(), 400),
        ("/v1/nope", b"{}", 404),
    ]
    with httpx.Client(base_url=base, headers=h, timeout=10) as http:
        for path, body, status in cases:
            r = http.post(path, content=body)
            assert r.status_code == status, (path, body[:60], r.text)
            assert "message" in r.json()["error"]
        assert http.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(base + "/health").status_code == 200  # no key needed
        assert httpx.get(base + "/v1/models").status_code == 401


@pytest.mark.timeout(60)
def test_metrics_exposes_engine_state(server):
    base, _ = server
    text = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for name in ("zeal_num_requests_waiting", "zeal_num_requests_running", "zeal_kv_blocks_used",
                 "zeal_generation_tokens_per_second", "zeal_time_to_first_token_seconds_bucket",
                 "zeal_time_per_output_token_seconds_bucket"):
        assert name in text


@pytest.mark.timeout(60)
def test_aborted_stream_frees_blocks(server):
    base, aengine = server
    engine = aengine.engine
    body = {"model": "tiny", "prompt": "stream me", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=10) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(3)]
            assert got[0].startswith("data: ")
            assert engine.bm.num_used_blocks > 0
    deadline = time.monotonic() + 10  # the connection is closed: the request must go away
    while (engine.requests or engine.bm.num_used_blocks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.requests
    assert engine.bm.num_used_blocks == 0


@pytest.mark.timeout(60)
def test_full_queue_answers_429(llama_dir):
    from fastapi.testclient import TestClient

    app = build_app(AsyncEngine(_engine(llama_dir), max_waiting=0), "tiny")
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "stream": True})
        assert r.status_code == 429
