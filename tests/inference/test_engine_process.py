"""The engine in its own process (``server.engine_process``): the same answers as the engine
thread, streaming, aborts that free the child's KV blocks, metrics carried over, a load
failure reported at start-up, and a dead engine answered with 503, never a hang."""

from __future__ import annotations

import os
import time

import httpx
import pytest

from zeal.config.inference import InferenceConfig
from zeal.inference.async_engine import AsyncEngine
from zeal.inference.engine import LLMEngine
from zeal.inference.engine_process import EngineProcess
from zeal.inference.llm import load_model_and_tokenizer
from zeal.inference.server import build_app
from zeal.inference.tokenizer import Tokenizer

ENGINE = {"block_size": 4, "num_blocks": 128, "max_num_batched_tokens": 64}


def _cfg(path) -> InferenceConfig:
    return InferenceConfig.model_validate({"model": str(path), "dtype": "fp32", "engine": ENGINE,
                                           "process": {"num_threads": 1}})


@pytest.fixture(scope="module")
def process_server(llama_dir, serve_app):
    ep = EngineProcess(_cfg(llama_dir), Tokenizer.from_folder(llama_dir), max_waiting=16)
    with serve_app(build_app(ep, "tiny")) as base:
        yield base, ep


def _complete(base: str, prompt, n_tokens: int = 6) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": n_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 2}
    r = httpx.post(base + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.timeout(90)
def test_same_answers_as_the_engine_thread(process_server, llama_dir, serve_app):
    base, ep = process_server
    assert ep.pid not in (None, os.getpid()) and ep._proc.is_alive()
    prompts = ["hello", "abc def", [5, 9, 11, 40, 2]]
    got = [_complete(base, p) for p in prompts]
    model, tok, eos = load_model_and_tokenizer(llama_dir)
    from zeal.config.inference import EngineConfig

    thread = AsyncEngine(LLMEngine(model, tok, EngineConfig(**ENGINE), eos))
    with serve_app(build_app(thread, "tiny")) as ref_base:
        want = [_complete(ref_base, p) for p in prompts]
    for g, w in zip(got, want):
        assert g["choices"][0]["text"] == w["choices"][0]["text"]
        glp, wlp = g["choices"][0]["logprobs"], w["choices"][0]["logprobs"]
        assert glp["tokens"] == wlp["tokens"] and glp["top_logprobs"] == wlp["top_logprobs"]
        assert glp["token_logprobs"] == pytest.approx(wlp["token_logprobs"], abs=1e-5)


@pytest.mark.timeout(60)
def test_stream_abort_frees_blocks_and_metrics_count(process_server):
    base, ep = process_server
    body = {"model": "tiny", "prompt": "stream me", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=base, timeout=10) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            next(lines)
            assert ep.engine.bm.num_used_blocks > 0
    deadline = time.monotonic() + 10
    while (ep.engine.bm.num_used_blocks or ep.engine.num_running) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ep.engine.bm.num_used_blocks == 0 and ep.engine.num_running == 0
    done = _complete(base, "count me", n_tokens=3)
    text = httpx.get(base + "/metrics", timeout=10).text
    gen = next(float(x.split()[-1]) for x in text.splitlines() if x.startswith("zeal_generation_tokens_total "))
    assert gen >= done["usage"]["completion_tokens"]
    assert 'zeal_requests_finished_total{reason="length"}' in text


@pytest.mark.timeout(60)
def test_bad_requests_are_4xx_from_the_child(process_server):
    base, _ = process_server
    r = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": [5, 999], "max_tokens": 2}, timeout=10)
    assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]
    r = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 10 ** 6}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert _complete(base, "still fine", 2)["choices"][0]["finish_reason"] == "length"


@pytest.mark.timeout(60)
def test_load_failure_is_one_error_at_start(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with pytest.raises(ValueError, match="no-such-architecture"):
        EngineProcess(_cfg(tmp_path), None, startup_timeout=50)


@pytest.mark.timeout(90)
def test_dead_engine_answers_503(process_server):
    """Last in the file: it kills the module's engine process (the file runs in order, on
    one worker), which saves starting another."""
    base, ep = process_server
    assert _complete(base, "ok", 2)["usage"]["completion_tokens"] == 2
    ep._proc.kill()
    ep._proc.join(10)
    r = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=20)
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
