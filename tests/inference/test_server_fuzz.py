"""A schema-driven fuzz of the HTTP API: schemathesis draws requests from the app's own
OpenAPI schema (bodies that fit it, and bodies that break it) against a live server on
127.0.0.1. No answer may be a 5xx; every 4xx is an OpenAI-style JSON error; afterwards the
server still answers and every KV block is free. Derandomized and bounded in examples."""

from __future__ import annotations

import copy
import json
import time
from collections import Counter

import httpx
import pytest

from tests.tiers import budget
from zeal.inference.async_engine import AsyncEngine
from zeal.inference.engine import EngineConfig, LLMEngine
from zeal.inference.llm import load_model_and_tokenizer
from zeal.inference.server import ServerLimits, build_app, uvicorn_limits

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {KEY}"}
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def fuzz_server(llama_dir, serve_app):
    model, tok, eos = load_model_and_tokenizer(llama_dir)
    # a short context and small n / prompt counts keep every valid request to a few ms
    cfg = EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=64, max_model_len=32)
    aengine = AsyncEngine(LLMEngine(model, tok, cfg, eos), max_waiting=16)
    limits = ServerLimits(max_n=2, max_prompts=2, max_body_bytes=1 << 16, body_read_timeout_s=5)
    app = build_app(aengine, "tiny", api_key=KEY, limits=limits)
    with serve_app(app, **uvicorn_limits(limits)) as base:
        yield app, base, aengine


def _within_limits(schema: dict) -> dict:
    """The schema narrowed to what this server accepts beyond what the schema can say (the
    served model name, n, prompt counts and lengths, token ids, non-null user content), so
    that most drawn bodies reach the engine; the schema as served is fuzzed too."""
    schema = copy.deepcopy(schema)
    comps = schema["components"]["schemas"]
    token = {"type": "integer", "minimum": 0, "maximum": 95}
    text = {"type": "string", "minLength": 1, "maxLength": 12}
    short = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 8}, {"type": "null"}]}
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = comps[name]["properties"]
        props.update(model={"enum": ["tiny"]}, max_tokens=short, n={"type": "integer", "minimum": 1, "maximum": 2},
                     stop={"anyOf": [text, {"type": "array", "items": text, "maxItems": 2}, {"type": "null"}]})
    comps["CompletionRequest"]["properties"]["prompt"] = {"anyOf": [
        text, {"type": "array", "items": text, "minItems": 1, "maxItems": 2},
        {"type": "array", "items": token, "minItems": 1, "maxItems": 12},
        {"type": "array", "items": {"type": "array", "items": token, "minItems": 1, "maxItems": 12},
         "minItems": 1, "maxItems": 2}]}
    chat = comps["ChatCompletionRequest"]["properties"]
    chat["max_completion_tokens"] = short
    chat["messages"] |= {"maxItems": 3}
    msg = comps["ChatMessage"]
    msg["properties"]["content"] = {"anyOf": [text, {"type": "array", "maxItems": 2,
                                                     "items": {"$ref": "#/components/schemas/TextPart"}}]}
    msg["required"] = ["role", "content"]
    return schema


@pytest.mark.timeout(300)
@budget(ci=30, long=200)
def test_schema_fuzz_gets_no_5xx_and_json_errors(fuzz_server, max_examples):
    app, base, aengine = fuzz_server
    served = schemathesis.openapi.from_dict(app.openapi())
    narrow = schemathesis.openapi.from_dict(_within_limits(app.openapi()))
    strategies = []
    for path, methods in served.raw_schema["paths"].items():
        for method in methods:
            modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if method == "post" else [])
            strategies += [served[path][method.upper()].as_strategy(generation_mode=m) for m in modes]
            if method == "post":  # twice the weight: the bodies that reach the engine
                strategies += [narrow[path]["POST"].as_strategy()] * 2
    seen: Counter = Counter()
    reasons: Counter = Counter()

    @settings(max_examples=max_examples, derandomize=True, deadline=None, database=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=st.one_of(strategies))
    def check(case) -> None:
        r = case.call(base_url=base, headers=AUTH, timeout=30)
        seen[(case.operation.path, r.status_code)] += 1
        where = f"{case.operation.method} {case.operation.path} body={case.body!r:.300}"
        assert r.status_code < 500, f"{where} -> {r.status_code} {r.text[:300]}"
        if r.status_code >= 400:
            assert r.headers.get("content-type", [""])[0].startswith("application/json"), where
            err = r.json()["error"]
            assert set(err) == ERROR_KEYS and isinstance(err["message"], str), (where, err)
            reasons[err["message"][:50]] += 1

    check()
    print(dict(seen), reasons.most_common(12))
    assert sum(n for (p, s), n in seen.items() if p != "/health" and s == 200) > 0  # the fuzz reached the engine
    assert sum(n for (p, s), n in seen.items() if 400 <= s < 500) > 0
    # still answering, and nothing left in the engine
    assert httpx.get(base + "/health").status_code == 200
    r = httpx.post(base + "/v1/completions", json={"prompt": "ok", "max_tokens": 3}, headers=AUTH, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1
    engine = aengine.engine
    deadline = time.monotonic() + 10
    while (engine.requests or engine.bm.num_used_blocks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.requests and engine.bm.num_used_blocks == 0


# ------------------------------------------------------------ tools and structured outputs
def _profile_examples(default: int) -> int:
    """The loaded hypothesis profile's ``max_examples`` when a profile was chosen (e.g. by
    ``--hypothesis-profile``), else ``default`` (kept small: the suite runs it every time)."""
    from hypothesis import settings as hs

    chosen = getattr(hs, "_current_profile", None) not in (None, "default")
    return hs.default.max_examples if chosen else default


STRUCTURED_EXAMPLES = _profile_examples(30)
NAMES = ["get_weather", "book", "f"]
_LEAVES = [{"type": "string", "maxLength": 4}, {"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"},
           {"enum": ["a", "b", 1]}, {"const": "x"}, {"type": "null"}, {}, {"$ref": "#"}, {"$ref": "#/$defs/a"},
           {"$ref": "#/definitions/a"}, {"$ref": "#/$defs/missing"}, {"type": "strung"}, {"type": 5},
           {"type": "string", "pattern": "^a+$", "maxLength": 3}, {"type": "string", "pattern": "(("},
           {"type": "string", "format": "date"}, {"minimum": "x"}]


def _schemas():
    leaf = st.sampled_from(_LEAVES)
    node = st.recursive(leaf, lambda c: st.one_of(
        st.builds(lambda p, req: {"type": "object", "properties": p, "required": [k for k in p if req],
                                  "additionalProperties": False}, st.dictionaries(st.sampled_from("abc"), c, max_size=2),
                  st.booleans()),
        st.builds(lambda x: {"type": "array", "items": x, "maxItems": 2}, c),
        st.builds(lambda xs: {"anyOf": xs}, st.lists(c, min_size=1, max_size=2)),
        st.builds(lambda x: {"allOf": [x]}, c)), max_leaves=5)
    with_defs = st.builds(lambda s, d, key: s | {key: {"a": d}}, node.filter(lambda x: isinstance(x, dict)), node,
                          st.sampled_from(["$defs", "definitions"]))
    junk = st.dictionaries(st.text(max_size=4), st.one_of(st.integers(), st.text(max_size=3), st.none()), max_size=2)
    return st.one_of(node, with_defs, junk)


def _structured_fields():
    schema = _schemas()
    response_format = st.one_of(
        st.just({"type": "text"}), st.just({"type": "json_object"}),
        st.builds(lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}, schema),
        st.just({"type": "json_schema"}), st.just({"type": "yaml"}), st.just("json"))
    structured = st.one_of(
        st.builds(lambda r: {"regex": r}, st.one_of(st.sampled_from(["a+", "((", "[0-9]{1,3}", "(a|b)*c", "", "\\"]),
                                                    st.integers(), st.none())),
        st.builds(lambda g: {"grammar": g}, st.sampled_from(['start: "a"+', "start: foo", "start: /[ab]{1,4}/", "", 3])),
        st.builds(lambda s: {"json": s}, st.one_of(schema, st.just("{not json"), st.just([1]))),
        st.builds(lambda b: {"json_object": b}, st.one_of(st.booleans(), st.just("yes"))),
        st.just({"bogus": 1}), st.just({"regex": "a", "json": {}}), st.just({}), st.just([]))
    tool = st.one_of(
        st.builds(lambda n, p: {"type": "function", "function": {"name": n, "parameters": p}},
                  st.sampled_from(NAMES), schema),
        st.builds(lambda n: {"type": "function", "function": {"name": n}}, st.sampled_from(NAMES)),
        st.just({"type": "function", "function": {"name": ""}}), st.just({"type": "web"}), st.just("f"))
    tool_choice = st.one_of(
        st.sampled_from(["none", "auto", "required", "bogus", None, 5]),
        st.builds(lambda n: {"type": "function", "function": {"name": n}}, st.sampled_from(NAMES + ["nope"])),
        st.builds(lambda n: {"type": "function", "function": n}, st.sampled_from(NAMES)),
        st.just(["get_weather"]), st.just({"type": "function"}), st.just({"function": {"name": "f"}}))
    return {"response_format": response_format, "structured_outputs": structured,
            "tools": st.lists(tool, max_size=2), "tool_choice": tool_choice}


@pytest.mark.timeout(300)
def test_tools_and_structured_outputs_fuzz_gets_no_5xx(fuzz_server):
    pytest.importorskip("llguidance")
    _, base, aengine = fuzz_server
    fields = _structured_fields()
    chat = st.fixed_dictionaries(
        {"messages": st.just([{"role": "user", "content": "hi"}]), "max_tokens": st.integers(1, 8)},
        optional=fields | {"stream": st.booleans()})
    completion = st.fixed_dictionaries(
        {"prompt": st.just("ok"), "max_tokens": st.integers(1, 8)},
        optional={k: fields[k] for k in ("response_format", "structured_outputs")} | {"stream": st.booleans()})
    seen: Counter = Counter()

    @settings(max_examples=STRUCTURED_EXAMPLES, derandomize=True, deadline=None, database=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(path_body=st.one_of(st.tuples(st.just("/v1/chat/completions"), chat),
                               st.tuples(st.just("/v1/completions"), completion)))
    def check(path_body) -> None:
        path, body = path_body
        r = httpx.post(base + path, json=body, headers=AUTH, timeout=30)
        seen[r.status_code] += 1
        where = f"{path} body={body!r:.400}"
        assert r.status_code < 500, f"{where} -> {r.status_code} {r.text[:300]}"
        if r.status_code >= 400:
            err = r.json()["error"]
            assert set(err) == ERROR_KEYS and "\n" not in err["message"], (where, err)
        elif body.get("stream"):  # an error after the first event comes as an event: never the server's fault
            for line in r.text.splitlines():
                if line.startswith("data: {") and '"error"' in line:
                    assert json.loads(line[6:])["error"]["type"] != "server_error", (where, line)

    check()
    print(dict(seen))
    assert seen[200] > 0 and sum(n for s, n in seen.items() if 400 <= s < 500) > 0
    deadline = time.monotonic() + 10
    engine = aengine.engine
    while (engine.requests or engine.bm.num_used_blocks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.requests and engine.bm.num_used_blocks == 0
