"""No request can hurt another, and every bad input gets a 4xx: failures isolated per
request in the engine, hostile bodies, clients that leave, slow or idle connections."""

from __future__ import annotations

import json
import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import httpx
import pytest
import torch

import zeal.inference.engine as engine_mod
from zeal.inference.async_engine import AsyncEngine
from zeal.inference.device_sampler import sample_batch
from zeal.inference.engine import EngineConfig, LLMEngine
from zeal.inference.llm import load_model_and_tokenizer
from zeal.inference.sampler import sample
from zeal.inference.sampling_params import SamplingParams
from zeal.inference.server import ServerLimits, build_app, uvicorn_limits

KEY = "sk-hard"
AUTH = {"Authorization": f"Bearer {KEY}"}
ERROR_KEYS = {"message", "type", "param", "code"}
GOOD = [5, 9, 14, 20, 33, 41]  # token ids of the request that must not be hurt
OTHER = [7, 7, 8, 60, 61]


def _engine(path) -> LLMEngine:
    model, tok, eos = load_model_and_tokenizer(path)
    return LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=128, max_num_batched_tokens=64), eos)


def _run(engine: LLMEngine, reqs: dict) -> dict:
    """Add ``{rid: (prompt, params)}`` and step until all are done; the final outputs by id."""
    for rid, (prompt, params) in reqs.items():
        engine.add_request(rid, prompt, params)
    final = {}
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def _greedy(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def _check_isolated(engine: LLMEngine, bad: SamplingParams, match: str) -> None:
    want = _run(engine, {"solo": (GOOD, _greedy())})["solo"].outputs[0].token_ids
    outs = _run(engine, {"good": (GOOD, _greedy()), "bad": (OTHER, bad)})
    assert outs["good"].error is None and outs["good"].outputs[0].token_ids == want
    assert outs["bad"].error is not None and match in outs["bad"].error, outs["bad"].error
    assert outs["bad"].error_type == "server_error"
    assert not engine.requests and not engine.has_unfinished() and engine.bm.num_used_blocks == 0


# ------------------------------------------------------------ the engine isolates failures
@pytest.mark.timeout(60)
def test_failing_forward_pass_fails_only_its_request(llama_dir):
    engine = _engine(llama_dir)
    real = engine.runner.execute

    def execute(sched):  # the pass fails whenever the bad request is in it, after its 3rd token
        if any(c.seq.request_id == "bad" and len(c.seq.output_ids) >= 3 for c in sched.chunks):
            raise RuntimeError("injected forward failure")
        return real(sched)

    engine.runner.execute = execute
    _check_isolated(engine, SamplingParams(max_tokens=12, temperature=0.7, seed=1, ignore_eos=True),
                    "injected forward failure")


@pytest.mark.timeout(60)
def test_failing_fork_fails_only_its_request(llama_dir):
    bad = SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=0, ignore_eos=True)
    bad.seed = 2**64 - 1  # past validation: choice 1's seed (seed + 1) overflows when it forks
    _check_isolated(_engine(llama_dir), bad, "Overflow")


@pytest.mark.timeout(60)
def test_failing_sampling_fails_only_its_request(llama_dir, monkeypatch):
    bad = SamplingParams(max_tokens=12, temperature=0.9, seed=4, ignore_eos=True)

    def flaky_sample(logits, histories, params, *args):
        if any(p is bad and len(h[1]) >= 2 for p, h in zip(params, histories)):
            raise ValueError("injected sampling failure")
        return sample(logits, histories, params, *args)

    def flaky_batch(logits, histories, params, *args, **kw):  # the batched (device) sampler fails alike
        if any(p is bad and len(h[1]) >= 2 for p, h in zip(params, histories)):
            raise ValueError("injected sampling failure")
        return sample_batch(logits, histories, params, *args, **kw)

    monkeypatch.setattr(engine_mod, "sample", flaky_sample)  # the row-by-row retry
    monkeypatch.setattr(engine_mod, "sample_batch", flaky_batch)
    _check_isolated(_engine(llama_dir), bad, "injected sampling failure")


@pytest.mark.timeout(30)
def test_tiny_temperature_samples_greedily():
    torch.manual_seed(0)
    logits = torch.randn(3, 96) * 20
    for t in (1e-6, 1e-31, 1e-45):
        p = SamplingParams(temperature=t, seed=1)
        assert p.greedy
        got = sample(logits, [([1], [])] * 3, [p] * 3, [torch.Generator().manual_seed(1)] * 3)
        assert [r.token for r in got] == logits.argmax(-1).tolist()
    assert not SamplingParams(temperature=2e-5).greedy


# ------------------------------------------------------------ over HTTP
@pytest.fixture(scope="module")
def server(llama_dir, serve_app):
    limits = ServerLimits(body_read_timeout_s=1.0, header_read_timeout_s=1.0, keep_alive_timeout_s=1)
    aengine = AsyncEngine(_engine(llama_dir), max_waiting=64)
    app = build_app(aengine, "tiny", api_key=KEY, limits=limits)
    with serve_app(app, log_config=None, **uvicorn_limits(limits)) as base:
        yield base, aengine


def _post(base: str, body, path: str = "/v1/completions", timeout: float = 30) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(base + path, content=content, headers=AUTH | {"Content-Type": "application/json"},
                      timeout=timeout)


def _assert_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and err["message"]
    return err


def _wait_idle(engine: LLMEngine, seconds: float) -> float:
    t0 = time.monotonic()
    while (engine.requests or engine.bm.num_used_blocks) and time.monotonic() - t0 < seconds:
        time.sleep(0.02)
    assert not engine.requests and engine.bm.num_used_blocks == 0
    return time.monotonic() - t0


@pytest.mark.timeout(60)
def test_seed_that_overflows_a_choice_is_400_and_others_run_on(server):
    base, _ = server
    good = {"prompt": "Hello there", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    want = _post(base, good).json()["choices"][0]["text"]
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(_post, base, good)
        time.sleep(0.05)
        err = _assert_error(_post(base, {"prompt": "Hello", "max_tokens": 4, "seed": 18446744073709551615,
                                         "n": 2}), 400)
        assert err["param"] == "seed"
        ok = _post(base, {"prompt": "Hello", "max_tokens": 4, "seed": 2**63 - 1, "n": 2})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
        r = fut.result()
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want


@pytest.mark.timeout(60)
def test_engine_failure_of_one_request_is_its_503_only(server, monkeypatch):
    base, aengine = server
    runner = aengine.engine.runner
    real = runner.execute

    def execute(sched):
        if any(c.seq.prompt_ids[:4] == [3, 3, 3, 3] for c in sched.chunks):  # prompt "!!!!"
            raise RuntimeError("injected")
        return real(sched)

    good = {"prompt": "Hello there", "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    want = _post(base, good).json()["choices"][0]["text"]
    monkeypatch.setattr(runner, "execute", execute)
    with ThreadPoolExecutor(2) as ex:
        fut = ex.submit(_post, base, good)
        bad = [ex.submit(_post, base, {"prompt": "!!!!x", "max_tokens": 20, "stream": s}) for s in (False, True)]
        r = fut.result()
        bad_plain, bad_stream = (b.result() for b in bad)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
    assert _assert_error(bad_plain, 503)["type"] == "server_error"
    assert _assert_error(bad_stream, 503)["type"] == "server_error"  # fails before the first event
    _wait_idle(aengine.engine, 5)


HOSTILE = [
    ("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),  # RecursionError
    ("/v1/completions", b'{"prompt": [' + b"7" * 5001 + b"]}"),  # past Python's int-size limit
    ("/v1/completions", b'{"prompt": "abc\\ud800def"}'),  # a lone surrogate
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "abc\\ud800def"}]}'),
    ("/v1/completions", b'{"prompt": "a", "temperature": NaN}'),
    ("/v1/completions", b'{"prompt": "a", "max_tokens": Infinity}'),
    ("/v1/completions", b'{"prompt": "a", "max_tokens": "10"}'),
    ("/v1/completions", b'{"prompt": "a", "max_tokens": true}'),
    ("/v1/completions", b'{"prompt": "a", "max_tokens": 4.0}'),
    ("/v1/completions", b'{"prompt": "a", "temperature": "0.5"}'),
    ("/v1/completions", b'{"prompt": "a", "stream": 1}'),
    ("/v1/completions", b'{"prompt": "a", "n": true}'),
    ("/v1/completions", b'{"prompt": ["a", 3]}'),
    ("/v1/completions", b'{"prompt": "a", "seed": 9223372036854775808}'),
    ("/v1/completions", b'\xff\xfe\x00'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": null}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "assistant", "content": null}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}'),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path,body", HOSTILE, ids=[f"{i}" for i in range(len(HOSTILE))])
def test_hostile_body_gets_json_400(server, path, body):
    base, aengine = server
    _assert_error(_post(base, body, path), 400)
    assert httpx.get(base + "/health").status_code == 200


@pytest.mark.timeout(60)
def test_assistant_message_with_tool_calls_may_have_null_content(server):
    base, _ = server
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                  "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "user", "content": "and?"}]
    r = _post(base, {"messages": msgs, "max_tokens": 2}, "/v1/chat/completions")
    assert r.status_code == 200, r.text


@pytest.mark.timeout(60)
def test_api_key_compared_safely(server):
    base, _ = server
    for value in ("Bearer wrong", "", "Bearer " + KEY + "x", "Bearer sk-h\xe9rd"):
        r = httpx.get(base + "/v1/models", headers={"Authorization": value.encode("latin-1")})
        assert _assert_error(r, 401)["code"] == "invalid_api_key"
    assert httpx.get(base + "/v1/models", headers=AUTH).status_code == 200


@pytest.mark.timeout(60)
def test_tiny_temperature_is_greedy_over_http(server):
    base, _ = server
    body = {"prompt": "Hello", "max_tokens": 16, "ignore_eos": True}
    texts = [_post(base, body | {"temperature": t}).json()["choices"][0]["text"] for t in (0, 1e-35, 5e-324)]
    assert texts[0] == texts[1] == texts[2]


@pytest.mark.timeout(60)
def test_non_streaming_client_that_times_out_aborts_its_request(server, monkeypatch):
    base, aengine = server
    engine = aengine.engine
    real = engine.runner.execute

    def slow(sched):  # 20 ms a pass: 200 tokens would take over 4 s
        time.sleep(0.02)
        return real(sched)

    monkeypatch.setattr(engine.runner, "execute", slow)
    aborted = engine.metrics.requests_finished.get("abort", 0)
    body = {"prompt": "Hello", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        _post(base, body, timeout=0.5)
    assert _wait_idle(engine, 2.0) < 2.0  # gone well before the 4 s it would have run
    assert engine.metrics.requests_finished.get("abort", 0) == aborted + 1


def _raw(base: str) -> socket.socket:
    u = urlparse(base)
    return socket.create_connection((u.hostname, u.port), timeout=10)


def _read_until_closed(s: socket.socket) -> bytes:
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


@pytest.mark.timeout(60)
def test_slow_bodies_get_408_and_are_closed(server):
    base, _ = server
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 200\r\n\r\n").encode()
    socks = [_raw(base) for _ in range(5)]
    t0 = time.monotonic()
    for s in socks:
        s.sendall(head + b'{"prompt": "a')  # and never the rest
    replies = [_read_until_closed(s) for s in socks]
    assert time.monotonic() - t0 < 4  # the body deadline is 1 s
    for s, reply in zip(socks, replies):
        s.close()
        status, _, body = reply.partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 408") and set(json.loads(body)["error"]) == ERROR_KEYS


@pytest.mark.timeout(60)
def test_idle_and_half_sent_headers_are_closed(server):
    base, _ = server
    socks = [_raw(base) for _ in range(3)]
    socks[1].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers never finished
    t0 = time.monotonic()
    assert [_read_until_closed(s) for s in socks] == [b""] * 3
    assert time.monotonic() - t0 < 4  # the header deadline is 1 s
    for s in socks:
        s.close()


@pytest.mark.timeout(60)
def test_dropped_upload_logs_one_line(server, caplog):
    base, _ = server
    caplog.set_level(logging.INFO)
    s = _raw(base)
    s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
               "Content-Length: 100\r\n\r\n{\"prompt\"").encode())
    time.sleep(0.2)
    s.close()
    deadline = time.monotonic() + 5
    while not any("went away" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [r for r in caplog.records if "went away" in r.getMessage()]
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


@pytest.mark.timeout(60)
def test_connections_are_bounded(llama_dir, serve_app):
    """Idle connections are bounded apart from busy ones (test_server_hardening2 has more)."""
    limits = ServerLimits(max_connections=4, max_idle_connections=4, header_read_timeout_s=30)
    app = build_app(AsyncEngine(_engine(llama_dir)), "tiny", limits=limits)
    with serve_app(app, **uvicorn_limits(limits)) as base:
        idle = [_raw(base) for _ in range(6)]
        time.sleep(0.2)
        assert httpx.get(base + "/health").status_code == 200  # the oldest idle sockets made room
        assert [_read_until_closed(s) for s in idle[:3]] == [b""] * 3
        for s in idle:
            s.close()
