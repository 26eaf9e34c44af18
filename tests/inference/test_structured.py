"""Structured outputs (llguidance): every output parses and matches its schema.

A tiny random Llama over a character-level tokenizer (any token is as likely as any other,
so only the mask keeps outputs valid) generates under hypothesis-drawn small JSON schemas,
greedy and sampled; outputs are checked by json.loads and by a validator of the schema
subset written here. Also regex and any-JSON-object constraints, ``n > 1``, the OpenAI
``response_format`` through the server, and the errors for bad constraints.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zeal.inference import LLM, SamplingParams

pytest.importorskip("llguidance")

LEAVES = [
    {"type": "integer", "minimum": -5, "maximum": 120},
    {"type": "boolean"},
    {"type": "string", "maxLength": 6},
    {"enum": ["red", "green", 3]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
]  # (a "number" is left out: its fraction digits are unbounded, so its output may run to max_tokens)


def _objects(children):
    names = st.lists(st.sampled_from(["a", "bb", "id", "x_y", "name"]), min_size=1, max_size=3, unique=True)
    return names.flatmap(lambda ks: st.tuples(*[children for _ in ks]).map(
        lambda vs: {"type": "object", "properties": dict(zip(ks, vs)), "required": list(ks),
                    "additionalProperties": False}))


SCHEMAS = st.recursive(st.sampled_from(LEAVES), _objects, max_leaves=4).filter(lambda s: s.get("type") == "object")


def valid(v, s) -> bool:
    """The subset of JSON Schema used above, checked by hand."""
    if "enum" in s:
        return any(v == e and type(v) is type(e) for e in s["enum"])
    t = s["type"]
    if t == "object":
        return (isinstance(v, dict) and set(v) == set(s["properties"])
                and all(valid(v[k], sub) for k, sub in s["properties"].items()))
    if t == "array":
        return isinstance(v, list) and len(v) <= s["maxItems"] and all(valid(x, s["items"]) for x in v)
    if t == "integer":
        return type(v) is int and s["minimum"] <= v <= s["maximum"]
    if t == "boolean":
        return type(v) is bool
    return isinstance(v, str) and len(v) <= s["maxLength"]


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), block_size=16, num_blocks=128, enable_prefix_caching=True)


@pytest.mark.timeout(120)
@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, seed=st.integers(0, 1000))
def test_outputs_parse_and_match_their_schema(llm, schema, seed):
    prompt = [ord(c) - 30 for c in "give json:"]
    params = [SamplingParams(max_tokens=200, temperature=t, seed=seed, structured_outputs={"json": schema})
              for t in (0.0, 1.0)]
    for out in llm.generate([prompt, prompt], params):
        o = out.outputs[0]
        assert o.finish_reason == "stop", (schema, o.text)
        assert valid(json.loads(o.text), schema), (schema, o.text)


@pytest.mark.timeout(60)
def test_regex_json_object_and_n(llm):
    prompt = [ord(c) - 30 for c in "id:"]
    rx = SamplingParams(max_tokens=20, temperature=1.0, seed=5, n=3, structured_outputs={"regex": r"[a-c]{3}-[0-9]{2}"})
    outs = llm.generate([prompt], rx)[0].outputs
    assert len(outs) == 3 and all(re.fullmatch(r"[a-c]{3}-[0-9]{2}", o.text) for o in outs), [o.text for o in outs]
    obj = SamplingParams(max_tokens=240, temperature=0.0, structured_outputs={"json_object": True})
    o = llm.generate([prompt], obj)[0].outputs[0]
    assert o.finish_reason == "stop" and isinstance(json.loads(o.text), dict), o.text
    plain = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0))[0].outputs[0].text
    assert not re.fullmatch(r"[a-c]{3}-[0-9]{2}", plain)  # the random model alone does not


def test_bad_constraints_are_refused(llm):
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs={"regex": "a", "json": {"type": "object"}})
    with pytest.raises(ValueError, match="does not compile|structured outputs"):
        llm.generate([[5, 6]], SamplingParams(structured_outputs={"regex": "(unclosed"}))


@pytest.mark.timeout(60)
def test_response_format_through_the_server(llama_dir, serve_app):
    from openai import BadRequestError, OpenAI

    from zeal.inference.async_engine import AsyncEngine
    from zeal.inference.engine import EngineConfig, LLMEngine
    from zeal.inference.llm import load_model_and_tokenizer
    from zeal.inference.server import build_app

    model, tok, eos = load_model_and_tokenizer(llama_dir)
    engine = LLMEngine(model, tok, EngineConfig(block_size=16, num_blocks=64), eos)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": LEAVES[0]},
              "required": ["ok", "n"], "additionalProperties": False}
    with serve_app(build_app(AsyncEngine(engine), "tiny")) as base:
        c = OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=30)
        msgs = [{"role": "user", "content": "json please"}]
        r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=100, temperature=1.0, seed=2, n=2,
                                      response_format={"type": "json_schema",
                                                       "json_schema": {"name": "t", "schema": schema}})
        assert all(valid(json.loads(ch.message.content), schema) for ch in r.choices)
        r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=200, temperature=1.0, seed=3,
                                      response_format={"type": "json_object"})
        # any object is unbounded (a random model may stay in a string): this seed's output ends
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        assert isinstance(json.loads(r.choices[0].message.content), dict)
        r = c.completions.create(model="tiny", prompt="x", max_tokens=10, temperature=0,
                                 extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
        assert re.fullmatch("[0-9]{4}", r.choices[0].text)
        with pytest.raises(BadRequestError, match="json_schema.schema"):
            c.chat.completions.create(model="tiny", messages=msgs, response_format={"type": "json_schema",
                                                                                    "json_schema": {"name": "t"}})
