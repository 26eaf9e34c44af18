"""Tiny models: one thread each (threads only contend on a shared CI machine), and the
fused CPU kernels built while tests are collected (outside any per-test timeout;
tests/kernels.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.kernels import build_in_first_worker

build_in_first_worker()


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def build_tiny_folder(d: Path) -> Path:
    """A tiny Llama Hugging Face folder with a word-level tokenizer knowing the built-in
    arithmetic questions (no download)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from zeal.models.llama import Llama, LlamaConfig

    words = ["[UNK]", "<eos>", "What", "is", "?", "Reply", "with", "the", "number", "only", ".", "+", "-", "*",
             "user", "assistant", ":"] + [str(i) for i in range(-10, 82)]
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    torch.manual_seed(0)
    Llama(LlamaConfig(vocab_size=len(words), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      eos_token_id=1)).save_hf_folder(d)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return d
