"""Tiny random models saved as Hugging Face folders (built from configs, never downloaded)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import pytest
import torch

from tests.kernels import build_in_first_worker
from zeal.inference.kernels import cpu_kernels

VOCAB = 96

build_in_first_worker()  # the fused CPU kernels (tests/kernels.py)


@pytest.fixture(params=["fused", "torch"])
def kernels(request, monkeypatch):
    """Run with the fused CPU kernels (the default where they build) and with the pure-torch path."""
    if request.param == "torch":
        monkeypatch.setattr("zeal.inference.model_runner.cpu_kernels", lambda: None)
    elif cpu_kernels() is None:
        pytest.skip("fused CPU kernels unavailable here")
    return request.param


def _char_tokenizer_json() -> str:
    """A word-level tokenizer over single characters (enough for server tests)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = [chr(c) for c in range(32, 32 + VOCAB - 2)]
    vocab = {"<unk>": 0, "<eos>": 1} | {c: i + 2 for i, c in enumerate(chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return tok.to_str()


def _save_tokenizer(path) -> None:
    (path / "tokenizer.json").write_text(_char_tokenizer_json())
    tmpl = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "chat_template": tmpl}))


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    """Random Llama with grouped-query attention (4 query heads, 2 KV heads), sharded safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.08, eos_token_id=1, bos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path, max_shard_size="100KB")
    _save_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=256, n_embd=64, n_layer=2, n_head=4, initializer_range=0.08,
                     eos_token_id=1, bos_token_id=1)
    model = GPT2LMHeadModel(cfg).eval()
    path = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(path)
    _save_tokenizer(path)
    return path


def hf_greedy(path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Reference: transformers ``generate``, one prompt at a time (no padding effects)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 do_sample=False, attention_mask=torch.ones_like(ids))
            outs.append(out[0, len(p):].tolist())
    return outs


def stop_app(app) -> None:
    """Run a built app's lifespan to its end, so the engine it holds stops (an engine
    process would otherwise stay alive, and polling, until the test session ends)."""
    from fastapi.testclient import TestClient

    with TestClient(app):
        pass


def mixed_prompts(seed: int, count: int, lo: int, hi: int, prefix: list[int] | None = None) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(lo, hi + 1, (1,), generator=g))
        out.append((prefix or []) + torch.randint(2, VOCAB, (n,), generator=g).tolist())
    return out


@contextlib.contextmanager
def _serve(app, **uvicorn_kwargs):
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kw = {"log_level": "warning"} | uvicorn_kwargs
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, **kw))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 20
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.started
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        th.join(10)


@pytest.fixture(scope="session")
def serve_app():
    """``with serve_app(app, **uvicorn_kwargs) as base_url``: uvicorn on 127.0.0.1 in a thread."""
    return _serve
