"""What OpenAI clients meet: forced tool calls cut by ``length`` streamed as they are answered
whole, schemas without ``additionalProperties`` closed (the declared keys, each once),
``parallel_tool_calls``, ``service_tier``/``user``, chat ``n > 1`` log-probs, and a contract
test of every route against the OpenAI SDK's own pydantic types (``model_validate``)."""

from __future__ import annotations

import json

import httpx
import pytest

from zeal.inference.outputs import CompletionOutput
from zeal.inference.structured import close_objects

pytest.importorskip("llguidance")

NAME = "tiny"
# no additionalProperties anywhere: what pydantic's model_json_schema() and LangChain's bind_tools send
OPEN_TOOL = {"type": "function", "function": {
    "name": "set_level", "description": "Set a level",
    "parameters": {"type": "object", "properties": {"level": {"enum": [1, 2, 3]}, "loud": {"type": "boolean"},
                                                    "mode": {"enum": ["a", "b"]}},
                   "required": ["level"]}}}
MSGS = [{"role": "user", "content": "set it"}]


@pytest.fixture(scope="module")
def servers(llama_dir, serve_app):
    """The tiny model behind two servers: schemas closed (the default) and left open."""
    from zeal.inference.async_engine import AsyncEngine
    from zeal.inference.engine import EngineConfig, LLMEngine
    from zeal.inference.llm import load_model_and_tokenizer
    from zeal.inference.server import build_app

    model, tok, eos = load_model_and_tokenizer(llama_dir)
    engine = LLMEngine(model, tok, EngineConfig(block_size=16, num_blocks=96), eos)
    with serve_app(build_app(AsyncEngine(engine), NAME)) as closed:
        yield closed


def _sse(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), f"duplicate keys {keys}"
    return dict(pairs)


# ---------------------------------------------------------------- schemas closed
def test_close_objects_closes_declared_objects_only():
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "b": {"type": "object", "properties": {"y": {}}, "additionalProperties": True},
        "c": {"type": "array", "items": {"properties": {"z": {}}}},
        "d": {"anyOf": [{"properties": {"u": {}}}, {"type": "null"}]},
        "e": {"allOf": [{"properties": {"p": {}}}, {"properties": {"q": {}}}]},
        "f": {"type": "object"},
        "g": {"type": "object", "patternProperties": {"^k": {"properties": {"w": {}}}}},
        "const": {"const": {"properties": {"not": "a schema"}}},
    }, "$defs": {"M": {"properties": {"m": {}}}}}
    before = json.dumps(schema)
    out = close_objects(schema)
    assert json.dumps(schema) == before  # the input is not changed
    props = out["properties"]
    assert out["additionalProperties"] is False and out["$defs"]["M"]["additionalProperties"] is False
    assert props["a"]["additionalProperties"] is False
    assert props["b"]["additionalProperties"] is True  # said explicitly: kept
    assert props["c"]["items"]["additionalProperties"] is False
    assert props["d"]["anyOf"][0]["additionalProperties"] is False
    assert all("additionalProperties" not in p for p in props["e"]["allOf"])  # parts of one object: left open
    assert props["f"] == {"type": "object"}  # no declared keys: any object, as asked
    assert "additionalProperties" not in props["g"]  # patternProperties says what else may come
    assert props["g"]["patternProperties"]["^k"]["additionalProperties"] is False
    assert props["const"] == {"const": {"properties": {"not": "a schema"}}}  # data, not a schema


def test_close_objects_walks_deep_schemas_without_recursion():
    node: dict = {"type": "object", "properties": {}}
    root = node
    for _ in range(20000):
        child = {"type": "object", "properties": {}}
        node["properties"]["k"] = child
        node = child
    out = close_objects(root)
    depth = 0
    while out.get("properties", {}).get("k"):
        assert out["additionalProperties"] is False
        out, depth = out["properties"]["k"], depth + 1
    assert depth == 20000


@pytest.mark.timeout(120)
def test_forced_open_schema_tool_calls_complete_with_declared_keys_once(servers):
    """Sampled at temperature 1 over several seeds, every forced call completes, with only the
    declared keys, none twice (the schema says nothing of other keys)."""
    for seed in range(6):
        body = {"model": NAME, "messages": MSGS, "tools": [OPEN_TOOL], "tool_choice": "required",
                "max_tokens": 60, "temperature": 1.0, "seed": seed, "n": 2}
        r = httpx.post(servers + "/v1/chat/completions", json=body, timeout=60).json()
        for ch in r["choices"]:
            assert ch["finish_reason"] == "tool_calls", ch
            args = json.loads(ch["message"]["tool_calls"][0]["function"]["arguments"], object_pairs_hook=_no_duplicates)
            assert set(args) <= {"level", "loud", "mode"} and args["level"] in (1, 2, 3)


@pytest.mark.timeout(60)
def test_response_format_schema_closed_unless_it_says_otherwise(servers):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    body = {"model": NAME, "messages": MSGS, "max_tokens": 30, "temperature": 1.0, "seed": 3, "n": 3,
            "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}}
    r = httpx.post(servers + "/v1/chat/completions", json=body, timeout=60).json()
    for ch in r["choices"]:
        assert ch["finish_reason"] == "stop", ch
        assert set(json.loads(ch["message"]["content"], object_pairs_hook=_no_duplicates)) == {"ok"}


def test_sampling_params_close_schemas_only_under_the_flag():
    from types import SimpleNamespace

    from zeal.inference.protocol import ChatCompletionRequest
    from zeal.inference.server import _sampling

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    req = ChatCompletionRequest.model_validate({"messages": MSGS, "response_format": {
        "type": "json_schema", "json_schema": {"schema": schema}}})
    on = _sampling(SimpleNamespace(disable_additional_properties=True), req, 4, None)
    off = _sampling(SimpleNamespace(disable_additional_properties=False), req, 4, None)
    assert on.structured_outputs.json["additionalProperties"] is False
    assert "additionalProperties" not in off.structured_outputs.json


# ---------------------------------------------------------------- streaming forced calls
@pytest.mark.timeout(60)
def test_streamed_forced_call_cut_by_length_keeps_its_text(servers):
    """A forced call that runs out of tokens: its text arrives as content with finish_reason
    length, streamed as without streaming (it was a ``tool_calls: []`` chunk, the text lost)."""
    body = {"model": NAME, "messages": MSGS, "tools": [OPEN_TOOL], "tool_choice": "required", "max_tokens": 3,
            "temperature": 0, "logprobs": True}
    whole = httpx.post(servers + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    assert whole["finish_reason"] == "length" and whole["message"]["content"]
    chunks = _sse(servers + "/v1/chat/completions", body | {"stream": True})
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == whole["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert not any("tool_calls" in c["choices"][0]["delta"] for c in chunks)
    lps = sum((c["choices"][0]["logprobs"]["content"] for c in chunks if c["choices"][0]["logprobs"]), [])
    assert lps == whole["logprobs"]["content"]


# ---------------------------------------------------------------- fields clients send
def test_parallel_tool_calls_false_keeps_one_call():
    from zeal.inference.chat_choices import chat_message as _chat_message

    funcs = [OPEN_TOOL["function"]]
    two = ('<tool_call>{"name": "set_level", "arguments": {"level": 1}}</tool_call>'
           '<tool_call>{"name": "set_level", "arguments": {"level": 2}}</tool_call>')
    c = CompletionOutput(index=0, token_ids=[1], text=two, finish_reason="stop")
    assert len(_chat_message(c, funcs)[0]["tool_calls"]) == 2
    msg, reason = _chat_message(c, funcs, parallel=False)
    assert reason == "tool_calls" and [json.loads(t["function"]["arguments"]) for t in msg["tool_calls"]] == [{"level": 1}]


@pytest.mark.timeout(60)
def test_service_tier_user_and_parallel_tool_calls_accepted_or_refused_by_name(servers):
    base = {"model": NAME, "messages": MSGS, "max_tokens": 2, "temperature": 0}
    r = httpx.post(servers + "/v1/chat/completions", timeout=60, json=base | {
        "user": "u-1", "service_tier": "auto", "parallel_tool_calls": False, "tools": [OPEN_TOOL]})
    assert r.status_code == 200 and r.json()["service_tier"] == "default"
    r = httpx.post(servers + "/v1/chat/completions", json=base | {"service_tier": "flex"}, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and "service_tier" in err["message"] and err["param"] == "service_tier"
    r = httpx.post(servers + "/v1/completions", json={"model": NAME, "prompt": "a", "max_tokens": 2, "user": "u"},
                   timeout=60)
    assert r.status_code == 200


@pytest.mark.timeout(60)
def test_chat_n_greater_than_one_logprobs_per_choice_streamed_equal(servers):
    body = {"model": NAME, "messages": MSGS, "max_tokens": 5, "temperature": 1.0, "seed": 11, "n": 3,
            "logprobs": True, "top_logprobs": 2, "ignore_eos": True}
    whole = httpx.post(servers + "/v1/chat/completions", json=body, timeout=60).json()
    assert len(whole["choices"]) == 3
    for ch in whole["choices"]:
        content = ch["logprobs"]["content"]
        assert len(content) == 5 and "".join(x["token"] for x in content) == ch["message"]["content"]
        assert all(len(x["top_logprobs"]) == 2 for x in content)
    streamed: dict[int, list] = {0: [], 1: [], 2: []}
    for c in _sse(servers + "/v1/chat/completions", body | {"stream": True}):
        for ch in c["choices"]:
            streamed[ch["index"]] += (ch["logprobs"] or {}).get("content") or []
    for ch in whole["choices"]:
        assert streamed[ch["index"]] == ch["logprobs"]["content"]


# ---------------------------------------------------------------- contract with the SDK's types
CASES = {
    "completion": ("/v1/completions", {"prompt": "ab", "max_tokens": 3}),
    "completion-logprobs-n": ("/v1/completions", {"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 2, "logprobs": 2,
                                                  "n": 2, "temperature": 1.0, "seed": 1}),
    "chat": ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 3, "temperature": 0}),  # whole = streamed
    "chat-logprobs-n": ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 3, "n": 2, "temperature": 1.0,
                                                 "seed": 2, "logprobs": True, "top_logprobs": 1}),
    "chat-forced-tool": ("/v1/chat/completions", {"messages": MSGS, "tools": [OPEN_TOOL], "tool_choice": "required",
                                                  "max_tokens": 40, "temperature": 0}),
    "chat-forced-tool-length": ("/v1/chat/completions", {"messages": MSGS, "tools": [OPEN_TOOL], "max_tokens": 2,
                                                         "tool_choice": "required", "temperature": 0}),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(CASES))
def test_contract_every_route_validates_as_sdk_types(servers, case):
    """Each answer, whole and streamed (with usage), validates as the OpenAI SDK's own pydantic
    types: every field the reference marks required is present and of its type."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    route, body = CASES[case]
    body = {"model": NAME, **body}
    whole = httpx.post(servers + route, json=body, timeout=60)
    assert whole.status_code == 200, whole.text
    chat = route.endswith("chat/completions")
    (ChatCompletion if chat else Completion).model_validate(whole.json())
    chunks = _sse(servers + route, body | {"stream": True, "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"]["completion_tokens"] == whole.json()["usage"]["completion_tokens"]
    for c in chunks:
        if chat:
            ChatCompletionChunk.model_validate(c)
        else:  # the SDK types stream chunks as Completion, whose finish_reason is never null: fill it in
            Completion.model_validate(c | {"choices": [ch | {"finish_reason": ch["finish_reason"] or "length"}
                                                       for ch in c["choices"]]})


@pytest.mark.timeout(60)
def test_contract_models_and_errors(servers):
    from openai.types import Model

    listing = httpx.get(servers + "/v1/models", timeout=30).json()
    assert listing["object"] == "list" and [Model.model_validate(m).id for m in listing["data"]] == [NAME]
    assert Model.model_validate(httpx.get(servers + f"/v1/models/{NAME}", timeout=30).json()).id == NAME
    err = httpx.post(servers + "/v1/chat/completions", json={"model": NAME, "messages": []}, timeout=30)
    assert err.status_code == 400 and set(err.json()["error"]) == {"message", "type", "param", "code"}


def _replay(texts: list[str], funcs, forced_call=False) -> list[dict]:
    """The chunks of one streamed choice whose text grows through ``texts`` (then stops)."""
    from types import SimpleNamespace

    from zeal.inference.chat_choices import chat_chunks as _chat_chunks
    from zeal.inference.outputs import RequestOutput

    make = _chat_chunks(SimpleNamespace(), "id", NAME, 3, False, funcs, forced_call)
    chunks, prev = [], ""
    for k, text in enumerate(texts):
        last = k == len(texts) - 1
        c = CompletionOutput(index=0, token_ids=list(range(k + 1)), text=text, delta_text=text[len(prev):],
                             delta_token_ids=[k], finish_reason="stop" if last else None)
        chunks += list(make(0, RequestOutput("r", [1], [c], finished=last)))
        prev = text
    return [ch["choices"][0] for ch in chunks]


def test_streamed_auto_tool_answers_read_as_their_whole_answer():
    """tool_choice auto, streamed: an answer that is a call arrives as one tool_calls delta
    (as without streaming, where it is parsed whole); plain text streams as it comes."""
    funcs = [OPEN_TOOL["function"]]
    call = '{"name": "set_level", "arguments": {"level": 2}}'
    got = _replay([call[:5], call[:20], call], funcs)
    assert [("content" in g["delta"], "tool_calls" in g["delta"]) for g in got] == [(False, False), (False, True)]
    assert got[0]["delta"] == {"role": "assistant"}
    assert json.loads(got[-1]["delta"]["tool_calls"][0]["function"]["arguments"]) == {"level": 2}
    assert got[-1]["finish_reason"] == "tool_calls"
    tagged = "<tool_call>" + call + "</tool_call>"
    assert "tool_calls" in _replay(["<to", "<tool_call>{", tagged], funcs)[-1]["delta"]
    plain = _replay(["Hel", "Hello", "Hello there"], funcs)
    assert [g["delta"].get("content") for g in plain] == ["Hel", "lo", " there"]
    assert plain[-1]["finish_reason"] == "stop"
    not_call = _replay(["{", '{"a": 1}'], funcs)  # JSON, but no call: held, then content
    assert not_call[-1]["delta"]["content"] == '{"a": 1}' and not_call[-1]["finish_reason"] == "stop"
    assert "content" not in not_call[0]["delta"]
