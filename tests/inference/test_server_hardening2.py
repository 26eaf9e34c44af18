"""Hardening, round two (issue 31): no client can lock out or starve the others, and every
client mistake is a one-line 400.

- idle connections are capped apart from busy ones: a flood of silent sockets closes its
  own oldest sockets, /health and real requests still answer; every refusal is JSON;
- a per-request budget of sequences and tokens (400 naming the limit), and a fair share of
  every pass between client requests, counted in engine passes (not seconds);
- schema, regex, grammar and tool_choice mistakes are 400 ``invalid_request_error`` with
  one line, whether found when compiling, at the first mask or at a later one; forced
  tool calls resolve ``$defs`` / ``definitions``.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import time
from urllib.parse import urlparse

import httpx
import pytest

from zeal.inference.async_engine import AsyncEngine
from zeal.inference.engine import EngineConfig, LLMEngine
from zeal.inference.llm import load_model_and_tokenizer
from zeal.inference.sampling_params import SamplingParams
from zeal.inference.server import ServerLimits, build_app, uvicorn_limits

ERROR_KEYS = {"message", "type", "param", "code"}


def _engine(path, **kw) -> LLMEngine:
    model, tok, eos = load_model_and_tokenizer(path)
    cfg = {"block_size": 4, "num_blocks": 128, "max_num_batched_tokens": 64} | kw
    return LLMEngine(model, tok, EngineConfig(**cfg), eos)


LIMITS = ServerLimits(max_idle_connections=8, max_connections=3, header_read_timeout_s=30, body_read_timeout_s=30,
                      max_request_seqs=8, max_request_tokens=400)


@pytest.fixture(scope="module")
def server(llama_dir, serve_app):
    aengine = AsyncEngine(_engine(llama_dir), max_waiting=64)
    app = build_app(aengine, "tiny", limits=LIMITS)
    with serve_app(app, **uvicorn_limits(LIMITS)) as base:
        yield base, aengine


def _raw(base: str) -> socket.socket:
    u = urlparse(base)
    return socket.create_connection((u.hostname, u.port), timeout=10)


def _closed_by_server(s: socket.socket, wait: float) -> bool:
    s.settimeout(wait)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:  # reset
        return True


def _assert_json_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text[:300]
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and err["message"]
    return err


def _post(base: str, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=60)


# ------------------------------------------------------------ idle connections vs busy ones
@pytest.mark.timeout(60)
def test_idle_flood_costs_the_flooder_not_the_others(server):
    base, _ = server
    flood = [_raw(base) for _ in range(60)]  # far past max_idle_connections (8) and max_connections (3)
    try:
        time.sleep(0.3)
        for _ in range(3):
            assert httpx.get(base + "/health", timeout=10).status_code == 200
            r = _post(base, {"prompt": "Hello", "max_tokens": 4})
            assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text[:300]
        closed = [_closed_by_server(s, 0.2) for s in flood]
        assert all(closed[:50]), closed  # the oldest idle sockets were closed to make room
        assert sum(not c for c in closed) <= LIMITS.max_idle_connections
    finally:
        for s in flood:
            s.close()


@pytest.mark.timeout(60)
def test_busy_limit_answers_json_503_and_frees(server):
    base, _ = server
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    busy = [_raw(base) for _ in range(LIMITS.max_connections)]
    for s in busy:
        s.sendall(head + b'{"prompt"')  # past the head: each holds a request slot while its body trickles
    time.sleep(0.3)
    try:
        err = _assert_json_error(httpx.get(base + "/health", timeout=10), 503)
        assert err["code"] == "too_many_requests" and "max_connections" in err["message"]
    finally:
        for s in busy:
            s.close()
    deadline = time.monotonic() + 10
    while httpx.get(base + "/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_unparsable_request_head_gets_json_400(server):
    base, _ = server
    s = _raw(base)
    s.sendall(b"NOT HTTP AT ALL\x00\r\n\r\n")
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head, data[:300]
    assert set(json.loads(body)["error"]) == ERROR_KEYS


# ------------------------------------------------------------ per-request budget
@pytest.mark.timeout(60)
def test_request_budget_400_names_the_limit(server):
    base, _ = server
    err = _assert_json_error(_post(base, {"prompt": ["Answer:"] * 4, "n": 4, "max_tokens": 2}), 400)
    assert "16 sequences" in err["message"] and "max_request_seqs" in err["message"]
    assert "--max-request-seqs" in err["message"] and err["param"] == "n"
    err = _assert_json_error(_post(base, {"prompt": "a", "n": 4, "max_tokens": 120}), 400)
    assert "max_request_tokens" in err["message"] and err["param"] == "max_tokens"
    chat = {"messages": [{"role": "user", "content": "hi"}], "n": 9, "max_tokens": 2}
    assert "max_request_seqs" in _assert_json_error(_post(base, chat, "/v1/chat/completions"), 400)["message"]
    assert _post(base, {"prompt": ["Answer:"] * 4, "n": 2, "max_tokens": 2}).status_code == 200


def test_budget_flags_come_from_the_config():
    import argparse

    from zeal.cli.serve import add_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = config_from_args(p.parse_args(["--max-request-seqs", "5", "--max-request-tokens", "900",
                                         "--max-idle-connections", "7"]))
    assert (cfg.server.limits.max_request_seqs, cfg.server.limits.max_request_tokens) == (5, 900)
    assert cfg.server.limits.max_idle_connections == 7


# ------------------------------------------------------------ fairness, counted in passes
def _passes_to_finish(engine: LLMEngine, prompt: list[int], params: SamplingParams, group: str,
                      before: int = 0) -> int:
    """Engine passes from adding the request (after ``before`` passes of what is queued) to its end."""
    for _ in range(before):
        engine.step()
    engine.add_request("small", prompt, params, group=group)
    for n in range(1, 5000):
        if any(o.request_id == "small" and o.finished for o in engine.step()):
            return n
    raise AssertionError("the small request never finished")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kv", ["ample", "tight"])
def test_small_request_beside_a_maximal_one_within_the_stated_bound(llama_dir, kv):
    """The issue's case at engine scale: 64 prompts x n 16 (1024 sequences, the most
    ``max_prompts`` x ``max_n`` allow) beside a 24-token request. The scheduler's docstring
    bound: about 2x its solo passes beside one other request (here: 2 x solo + 1)."""
    cfg = {"block_size": 16, "max_num_batched_tokens": 256, "max_num_seqs": 32}
    cfg["num_blocks"] = 2048 if kv == "ample" else 80  # tight: the big request cannot all fit at once
    small = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompt = [5, 9, 14, 20, 33, 41, 7, 8, 9, 10]
    solo = _passes_to_finish(_engine(llama_dir, **cfg), prompt, small, "small")
    engine = _engine(llama_dir, **cfg)
    big = SamplingParams(n=16, max_tokens=4, temperature=1.0, seed=0, ignore_eos=True)
    for i in range(64):
        engine.add_request(f"big-{i}", [40 + i % 30, 41, 42, 43, 44, 45, 46], big, group="big")
    beside = _passes_to_finish(engine, prompt, small, "small", before=3)
    print(f"passes of the small request: alone {solo}, beside 64 x n 16 ({kv} KV): {beside}")
    assert solo == 24  # one pass for the prompt and the first token, one per further token
    assert beside <= 2 * solo + 1, (solo, beside)
    while engine.has_unfinished():  # and the big one still completes, every block freed
        engine.step()
    assert not engine.requests and engine.bm.num_used_blocks == 0


def test_scheduler_interleaves_groups():
    from zeal.inference.scheduler import interleave
    from zeal.inference.sequence import Sequence

    seqs = [Sequence(i, f"r{i}", [1], SamplingParams(), group=g) for i, g in enumerate("aaabca")]
    assert [s.seq_id for s in interleave(seqs)] == [0, 3, 4, 1, 2, 5]


# ------------------------------------------------------------ client mistakes are one-line 400s
needs_llguidance = pytest.mark.skipif(importlib.util.find_spec("llguidance") is None,
                                      reason="structured outputs need llguidance")

CHAT = {"messages": [{"role": "user", "content": "weather?"}], "max_tokens": 8}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]}}}


def _json_schema(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


MISTAKES = {
    "ref_cycle": _json_schema({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                               "$ref": "#/$defs/a"}),
    "ref_root": _json_schema({"$ref": "#"}),
    "ref_missing": _json_schema({"$ref": "#/$defs/nope"}),
    "ref_remote": _json_schema({"$ref": "http://example.com/s.json"}),
    "bad_type": _json_schema({"type": "strung"}),
    "regex_int": {"structured_outputs": {"regex": 5}},
    "regex_bad": {"structured_outputs": {"regex": "(("}},
    "grammar_bad": {"structured_outputs": {"grammar": "start: foo"}},
    "json_list": {"structured_outputs": {"json": [1, 2]}},
    "tool_choice_str_function": {"tools": [WEATHER], "tool_choice": {"type": "function", "function": "get_weather"}},
    "tool_choice_list": {"tools": [WEATHER], "tool_choice": ["get_weather"]},
    "tool_choice_function_list": {"tools": [WEATHER], "tool_choice": {"type": "function",
                                                                      "function": ["get_weather"]}},
    "tool_choice_unknown": {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    "tool_bad_params": {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}],
                        "tool_choice": "required"},
}


def _one_line_400(r: httpx.Response) -> str:
    err = _assert_json_error(r, 400)
    msg = err["message"]
    assert err["type"] == "invalid_request_error", err
    assert "\n" not in msg and "<state>" not in msg and len(msg) <= 400, msg
    return msg


@needs_llguidance
@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_schema_regex_grammar_and_tool_mistakes_are_one_line_400(server, name, stream):
    base, aengine = server
    _one_line_400(_post(base, CHAT | MISTAKES[name] | {"stream": stream}, "/v1/chat/completions"))
    assert not aengine.engine.requests


@needs_llguidance
@pytest.mark.timeout(120)
def test_pathological_patterns_are_400_or_served(server):
    """Constraints that compile slowly or blow up llguidance's limits: a 400 naming them, or a
    valid answer; never a 5xx."""
    base, _ = server
    for extra in (_json_schema({"type": "string", "pattern": "^(a{1000}){1000}$"}),
                  _json_schema({"enum": [{"k": i} for i in range(10_000)]})):
        r = _post(base, CHAT | extra, "/v1/chat/completions")
        if r.status_code != 200:
            _one_line_400(r)


@needs_llguidance
@pytest.mark.timeout(60)
def test_grammar_failing_at_a_later_mask_is_that_request_400(llama_dir):
    engine = _engine(llama_dir)
    from zeal.inference.structured import StructuredOutputsParams

    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine.add_request("good", [5, 9, 14], greedy)
    engine.add_request("bad", [5, 9, 14], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                         structured_outputs=StructuredOutputsParams(regex="abcdef")))
    engine.step()
    (seq,) = engine.requests["bad"].seqs
    seq.matcher.consume_token(engine.tokenizer.encode("z")[0])  # a token the regex refuses: the matcher fails
    final = {}
    while engine.has_unfinished():
        final |= {o.request_id: o for o in engine.step() if o.finished}
    assert final["bad"].error_type == "invalid_request_error"
    assert final["bad"].error.startswith("structured outputs:") and "\n" not in final["bad"].error
    assert final["good"].error is None and len(final["good"].outputs[0].token_ids) == 6


PYDANTIC_TOOL = {"type": "function", "function": {"name": "book", "parameters": {
    "$defs": {"City": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}},
                       "required": ["name"], "additionalProperties": False}},
    "definitions": {"Seats": {"type": "integer", "minimum": 1, "maximum": 4}},
    "type": "object", "properties": {"to": {"$ref": "#/$defs/City"}, "seats": {"$ref": "#/definitions/Seats"}},
    "required": ["to", "seats"], "additionalProperties": False}}}


@needs_llguidance
@pytest.mark.timeout(60)
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "book"}}])
def test_forced_tool_call_with_defs_and_definitions(server, choice):
    base, _ = server
    weather = json.loads(json.dumps(WEATHER))
    weather["function"]["parameters"]["additionalProperties"] = False  # else free extra keys: no bound on length
    body = CHAT | {"tools": [PYDANTIC_TOOL, weather], "tool_choice": choice, "max_tokens": 150, "temperature": 0}
    r = _post(base, body, "/v1/chat/completions")
    assert r.status_code == 200, r.text[:300]
    msg = r.json()["choices"][0]["message"]
    assert msg.get("tool_calls"), (msg, r.json()["choices"][0]["finish_reason"])
    (call,) = msg["tool_calls"]
    args = json.loads(call["function"]["arguments"])
    if call["function"]["name"] == "book":
        assert set(args) == {"to", "seats"} and 1 <= args["seats"] <= 4
        assert set(args["to"]) == {"name"} and len(args["to"]["name"]) <= 5
    else:
        assert set(args) == {"city"} and len(args["city"]) <= 6
