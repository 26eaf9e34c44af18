"""Multi-LoRA over HTTP: ``model`` picks the adapter, ``/v1/models`` lists them, the
load/unload endpoints and their 4xx, and load/unload under concurrent requests losing none.
The reference is HF + PEFT greedy decoding (tests/inference/test_multi_lora.py)."""

from __future__ import annotations

import concurrent.futures as cf
import json

import httpx
import pytest

from tests.inference.conftest import mixed_prompts
from tests.inference.test_multi_lora import make_adapter, peft_greedy
from zeal.config.inference import EngineConfig, InferenceConfig, LoRAServingConfig
from zeal.inference.async_engine import AsyncEngine
from zeal.inference.engine import LLMEngine
from zeal.inference.llm import load_model_and_tokenizer
from zeal.inference.server import build_app
from zeal.inference.tokenizer import Tokenizer

NEW = 6
ENGINE = {"block_size": 4, "num_blocks": 256, "max_num_batched_tokens": 64}


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("srv_adapters")
    qkvo = ["q_proj", "k_proj", "v_proj", "o_proj"]
    return {"a": str(make_adapter(llama_dir, root / "a", 21, r=4, lora_alpha=8, target_modules=qkvo)),
            "b": str(make_adapter(llama_dir, root / "b", 22, r=8, lora_alpha=8, target_modules=qkvo)),
            "c": str(make_adapter(llama_dir, root / "c", 23, r=2, lora_alpha=4, target_modules=["v_proj", "o_proj"])),
            "big": str(make_adapter(llama_dir, root / "big", 24, r=16, lora_alpha=16, target_modules=["q_proj"]))}


@pytest.fixture(scope="module")
def expected(llama_dir, adapters):
    """(prompts, {model name: the texts PEFT decodes greedily})."""
    tok = Tokenizer.from_folder(llama_dir)
    prompts = mixed_prompts(31, 3, 4, 12)
    ref = {"tiny": peft_greedy(llama_dir, None, prompts, NEW)}
    for n in ("a", "b", "c"):
        ref[n] = peft_greedy(llama_dir, adapters[n], prompts, NEW)
    return prompts, {n: [tok.decode(t) for t in toks] for n, toks in ref.items()}


def _thread_app(llama_dir, loras: dict[str, str], runtime: bool = True):
    model, tok, eos = load_model_and_tokenizer(llama_dir)
    lcfg = LoRAServingConfig(lora_modules=[f"{k}={v}" for k, v in loras.items()], max_loras=3, max_lora_rank=8,
                             allow_runtime_lora_updating=runtime)
    return build_app(AsyncEngine(LLMEngine(model, tok, EngineConfig(**ENGINE, lora=lcfg), eos)), "tiny")


def _complete(base: str, model: str, prompt: list[int]) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True}
    return httpx.post(base + "/v1/completions", json=body, timeout=60)


def _post(base: str, path: str, body) -> httpx.Response:
    return httpx.post(base + path, content=json.dumps(body), headers={"content-type": "application/json"},
                      timeout=30)


@pytest.mark.timeout(90)
def test_model_field_picks_adapter_concurrently(llama_dir, adapters, expected, serve_app):
    """Concurrent requests for the base, a and b (batched together) each get PEFT's text;
    the models list shows the adapters with their parent; an unknown model is a 404."""
    prompts, ref = expected
    with serve_app(_thread_app(llama_dir, {"a": adapters["a"], "b": adapters["b"]})) as base:
        jobs = [(m, i) for i in range(len(prompts)) for m in ("tiny", "a", "b")]
        with cf.ThreadPoolExecutor(len(jobs)) as pool:
            resp = list(pool.map(lambda j: _complete(base, j[0], prompts[j[1]]), jobs))
        for (m, i), r in zip(jobs, resp):
            assert r.status_code == 200, r.text
            assert r.json()["model"] == m
            assert r.json()["choices"][0]["text"] == ref[m][i], (m, i)
        cards = httpx.get(base + "/v1/models").json()["data"]
        assert [c["id"] for c in cards] == ["tiny", "a", "b"]
        assert cards[1]["parent"] == "tiny" and cards[1]["root"] == adapters["a"]
        assert httpx.get(base + "/v1/models/b").json()["parent"] == "tiny"
        r = _complete(base, "nope", prompts[0])
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.timeout(90)
def test_load_unload_endpoints_and_errors(llama_dir, adapters, expected, serve_app, tmp_path):
    prompts, ref = expected
    with serve_app(_thread_app(llama_dir, {"a": adapters["a"]}, runtime=False)) as base:
        r = _post(base, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": adapters["c"]})
        assert r.status_code == 404 and "--allow-runtime-lora-updating" in r.json()["error"]["message"]
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"]}')
    with serve_app(_thread_app(llama_dir, {"a": adapters["a"]})) as base:
        cases = [({"lora_name": "c", "lora_path": str(tmp_path / "missing")}, 404, "no LoRA adapter folder"),
                 ({"lora_name": "c", "lora_path": str(tmp_path / "bad")}, 400, "adapter_model.safetensors"),
                 ({"lora_name": "c", "lora_path": adapters["big"]}, 400, "exceeds max_lora_rank 8"),
                 ({"lora_name": "a", "lora_path": adapters["c"]}, 400, "already loaded"),
                 ({"lora_name": "tiny", "lora_path": adapters["c"]}, 400, "base model"),
                 ({"lora_name": "c"}, 400, "lora_path")]
        for body, status, msg in cases:
            r = _post(base, "/v1/load_lora_adapter", body)
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert msg in err["message"] and {"message", "type", "param", "code"} <= set(err)
        r = _post(base, "/v1/unload_lora_adapter", {"lora_name": "c"})
        assert r.status_code == 404 and "not loaded" in r.json()["error"]["message"]
        r = _post(base, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": adapters["c"]})
        assert r.status_code == 200 and "added successfully" in r.text
        assert [c["id"] for c in httpx.get(base + "/v1/models").json()["data"]] == ["tiny", "a", "c"]
        assert _complete(base, "c", prompts[1]).json()["choices"][0]["text"] == ref["c"][1]
        r = _post(base, "/v1/unload_lora_adapter", {"lora_name": "c"})
        assert r.status_code == 200 and "removed successfully" in r.text
        assert _complete(base, "c", prompts[1]).status_code == 404
        for name in ("b", "c"):  # 3 slots: a, b, c
            assert _post(base, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": adapters[name]}).is_success
        r = _post(base, "/v1/load_lora_adapter", {"lora_name": "d", "lora_path": adapters["a"]})
        assert r.status_code == 400 and "max_loras 3" in r.json()["error"]["message"]


def _churn_and_load(base: str, prompts, ref, rounds: int) -> None:
    """Requests for the base, a and c in flight while c is unloaded and loaded again and a is
    unloaded and reloaded: every request for a served name completes with its adapter's
    text; a request for c while it is away gets 404 (refused, not lost)."""
    def client(k: int):
        m = ("tiny", "a", "c")[k % 3]
        i = k % len(prompts)
        r = _complete(base, m, prompts[i])
        if r.status_code == 404 and m != "tiny":
            return "refused"
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref[m][i], (m, i)
        return "ok"

    def admin():
        for _ in range(rounds):
            for name in ("c", "a"):
                assert _post(base, "/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200
                r = _post(base, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": ADAPTERS[name]})
                assert r.status_code == 200, r.text
        return "admin"

    with cf.ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(client, k) for k in range(24)]
        futs.insert(6, pool.submit(admin))
        results = [f.result() for f in futs]
    assert results.count("ok") >= 8 and "admin" in results


ADAPTERS: dict[str, str] = {}


@pytest.mark.timeout(120)
def test_load_unload_under_load_loses_nothing(llama_dir, adapters, expected, serve_app):
    prompts, ref = expected
    ADAPTERS.update(adapters)
    with serve_app(_thread_app(llama_dir, {"a": adapters["a"], "c": adapters["c"]})) as base:
        _churn_and_load(base, prompts, ref, rounds=3)
        # every slot came back: nothing leaked by the unloads of adapters in use
        assert [c["id"] for c in httpx.get(base + "/v1/models").json()["data"]] == ["tiny", "c", "a"]


@pytest.mark.timeout(120)
def test_engine_process_serves_and_swaps_adapters(llama_dir, adapters, expected, serve_app):
    """The default serving mode (the engine in its own process): --lora-modules loaded in the
    child, listed by the parent, load/unload through the pipe under load."""
    from zeal.inference.engine_process import EngineProcess

    prompts, ref = expected
    ADAPTERS.update(adapters)
    cfg = InferenceConfig.model_validate({
        "model": str(llama_dir), "dtype": "fp32", "process": {"num_threads": 1},
        "engine": ENGINE | {"lora": {"lora_modules": [f"a={adapters['a']}", json.dumps({"name": "c", "path": adapters["c"]})],
                                     "max_loras": 3, "max_lora_rank": 8, "allow_runtime_lora_updating": True}}})
    ep = EngineProcess(cfg, Tokenizer.from_folder(llama_dir), max_waiting=64)
    with serve_app(build_app(ep, "tiny")) as base:
        assert [c["id"] for c in httpx.get(base + "/v1/models").json()["data"]] == ["tiny", "a", "c"]
        _churn_and_load(base, prompts, ref, rounds=2)
        r = _post(base, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": adapters["big"]})
        assert r.status_code == 400 and "exceeds max_lora_rank" in r.json()["error"]["message"]
