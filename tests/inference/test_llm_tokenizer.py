"""``LLM(path, tokenizer=...)``: the tokenizer given (object, folder or tokenizer.json)
replaces the model folder's own, and its end-of-sequence token stops generation."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")


def test_tokenizer_argument_replaces_the_folders(tmp_path):
    from zeal.data.corpus import stdlib_corpus
    from zeal.data.tokenizer import train_tokenizer
    from zeal.inference import LLM, SamplingParams
    from zeal.inference.tokenizer import Tokenizer

    docs = stdlib_corpus(40_000).documents
    own, other = train_tokenizer(docs[: len(docs) // 2], 280), train_tokenizer(docs, 300)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=300,
                                                         n_positions=32)).save_pretrained(tmp_path / "model")
    own.save(str(tmp_path / "model" / "tokenizer.json"))
    (tmp_path / "tok").mkdir()
    other.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    text = "def main(argv):\n    return 0\n"
    assert own.encode(text).ids != other.encode(text).ids
    assert LLM(str(tmp_path / "model")).tokenizer.encode(text) == own.encode(text).ids
    for given in (tmp_path / "tok", str(tmp_path / "tok" / "tokenizer.json"), Tokenizer.from_folder(tmp_path / "tok")):
        llm = LLM(str(tmp_path / "model"), tokenizer=given)
        assert llm.tokenizer.encode(text) == other.encode(text).ids
        out = llm.generate(text, SamplingParams(max_tokens=3, temperature=0.0))[0]
        assert out.prompt_token_ids == other.encode(text).ids
    assert 0 in LLM(str(tmp_path / "model"), tokenizer=tmp_path / "tok").engine.eos_token_ids
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        LLM(str(tmp_path / "model"), tokenizer=tmp_path / "missing")
