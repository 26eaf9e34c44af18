"""``logprobs`` / ``top_logprobs`` of chat completions in OpenAI's shape, checked against
log-softmax of Hugging Face's logits for the same tokens; token bytes against the text."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from zeal.inference.async_engine import AsyncEngine
from zeal.inference.engine import EngineConfig, LLMEngine
from zeal.inference.llm import load_model_and_tokenizer
from zeal.inference.server import build_app
from zeal.inference.tokenizer import Tokenizer

MSGS = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def chat_server(llama_dir, serve_app):
    model, tok, eos = load_model_and_tokenizer(llama_dir)
    engine = LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=64), eos)
    with serve_app(build_app(AsyncEngine(engine), "tiny")) as base:
        yield base, tok


@pytest.mark.timeout(60)
def test_chat_top_logprobs_match_hf(chat_server, llama_dir):
    from openai import OpenAI
    from transformers import AutoModelForCausalLM

    base, tok = chat_server
    c = OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=30)
    r = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=5, temperature=0, logprobs=True,
                                  top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert "".join(x.token for x in content) == r.choices[0].message.content
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    prompt = tok.encode_chat(MSGS)
    gen = [tok.tok.token_to_id(x.token) for x in content]
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([prompt + gen])).logits[0, len(prompt) - 1 : -1].float(), -1)
    for i, x in enumerate(content):
        assert x.logprob == pytest.approx(float(lp[i, gen[i]]), abs=1e-4)
        assert x.bytes == list(x.token.encode())
        top = torch.topk(lp[i], 3)
        assert [tok.tok.token_to_id(t.token) for t in x.top_logprobs] == top.indices.tolist()
        assert [t.logprob for t in x.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert x.top_logprobs[0].logprob >= x.logprob - 1e-6  # greedy: the chosen token is the top one


@pytest.mark.timeout(60)
def test_streamed_logprobs_equal_non_streamed(chat_server):
    base, _ = chat_server
    body = {"model": "tiny", "messages": MSGS, "max_tokens": 6, "temperature": 0, "logprobs": True,
            "top_logprobs": 2, "ignore_eos": True}
    full = httpx.post(base + "/v1/chat/completions", json=body, timeout=30).json()
    streamed = []
    with httpx.stream("POST", base + "/v1/chat/completions", json=body | {"stream": True}, timeout=30) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for ch in json.loads(line[6:])["choices"]:
                    streamed += (ch.get("logprobs") or {}).get("content", [])
    assert streamed == full["choices"][0]["logprobs"]["content"] and len(streamed) == 6
    bad = httpx.post(base + "/v1/chat/completions", json=body | {"logprobs": False}, timeout=30)
    assert bad.status_code == 400 and "top_logprobs" in bad.json()["error"]["message"]


def test_token_bytes_rebuild_the_text_byte_level_bpe():
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    text = "Café déjà vu, 日本語のテキスト, naïve façade; ünïcödé everywhere. " * 4
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = Tokenizer(hf)
    for s in ("日本", "déjà vu", "naïve ü"):
        ids = tok.encode(s)
        assert b"".join(bytes(tok.token_bytes(i)) for i in ids) == s.encode()
    assert any(len(tok.decode([i]).encode()) != len(tok.token_bytes(i)) for i in tok.encode("日本語"))  # split chars
