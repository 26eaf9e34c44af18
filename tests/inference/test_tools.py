"""Tool calls: a round trip through the server with the openai client, forced calls that
always parse and match the tool's parameters, streaming equal to non-streaming, and the
parser of free answers checked on hand-written texts."""

from __future__ import annotations

import json

import pytest

from zeal.inference.tools import parse_tool_calls

pytest.importorskip("llguidance")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}},
                                       "required": ["tz"], "additionalProperties": False}}}
FUNCS = [WEATHER["function"], TIME["function"]]


def test_parse_tool_calls_of_free_answers():
    bare = parse_tool_calls('{"name": "get_time", "arguments": {"tz": "UTC"}}', FUNCS)
    assert bare[0]["function"] == {"name": "get_time", "arguments": '{"tz": "UTC"}'} and bare[0]["type"] == "function"
    two = parse_tool_calls('<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>\n'
                           '<tool_call>{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "C"}}</tool_call>',
                           FUNCS)
    assert [c["function"]["name"] for c in two] == ["get_time", "get_weather"]
    assert json.loads(two[1]["function"]["arguments"]) == {"city": "Oslo", "unit": "C"}
    assert parse_tool_calls("The weather is fine.", FUNCS) is None
    assert parse_tool_calls('{"name": "rm_rf", "arguments": {}}', FUNCS) is None  # not a known tool


@pytest.fixture(scope="module")
def client(llama_dir, serve_app):
    from openai import OpenAI

    from zeal.inference.async_engine import AsyncEngine
    from zeal.inference.engine import EngineConfig, LLMEngine
    from zeal.inference.llm import load_model_and_tokenizer
    from zeal.inference.server import build_app

    model, tok, eos = load_model_and_tokenizer(llama_dir)
    engine = LLMEngine(model, tok, EngineConfig(block_size=16, num_blocks=64), eos)
    with serve_app(build_app(AsyncEngine(engine), "tiny")) as base:
        yield OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=30)


def _args_ok(call) -> bool:
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        return set(args) == {"city", "unit"} and len(args["city"]) <= 8 and args["unit"] in ("C", "F")
    return args == {"tz": "UTC"} or args == {"tz": "CET"}


@pytest.mark.timeout(60)
def test_tool_call_round_trip(client):
    msgs = [{"role": "user", "content": "weather in Oslo?"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=[WEATHER, TIME], max_tokens=80,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       temperature=1.0, seed=4, n=2)
    for ch in r.choices:
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        call = ch.message.tool_calls[0]
        assert call.function.name == "get_weather" and _args_ok(call) and call.id.startswith("call_")
    r2 = client.chat.completions.create(model="tiny", messages=msgs, tools=[WEATHER, TIME], tool_choice="required",
                                        max_tokens=80, temperature=0)
    assert _args_ok(r2.choices[0].message.tool_calls[0])
    call = r.choices[0].message.tool_calls[0]
    follow = msgs + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    r3 = client.chat.completions.create(model="tiny", messages=follow, tools=[WEATHER], tool_choice="none",
                                        max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert r3.choices[0].finish_reason == "length" and r3.choices[0].message.tool_calls is None
    assert r3.usage.completion_tokens == 5 and isinstance(r3.choices[0].message.content, str)


@pytest.mark.timeout(60)
def test_streamed_forced_call_equals_non_streamed(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "time?"}], tools=[WEATHER, TIME],
              tool_choice="required", max_tokens=80, temperature=0)
    full = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    got = [tc for ch in client.chat.completions.create(stream=True, **kw) for c in ch.choices
           for tc in (c.delta.tool_calls or [])]
    assert len(got) == 1 and got[0].index == 0
    assert (got[0].function.name, got[0].function.arguments) == (full.function.name, full.function.arguments)
    from openai import BadRequestError

    with pytest.raises(BadRequestError, match="not among the tools"):
        client.chat.completions.create(**kw | {"tool_choice": {"type": "function", "function": {"name": "nope"}}})
