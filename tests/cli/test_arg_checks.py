"""Flags refused at start-up, before anything is loaded (issue 31): `zeal compress` with a
pruning method and no --sparsity, a NaN learning rate, a group size that divides no
linear of the model; `zeal data analyze` past --max-bytes or with a negative seed; a
model section asking for expert parallelism without experts. Each is one line, and the
loaders are replaced by a trap so that a check made after loading fails the test."""

from __future__ import annotations

import json

import pytest

from zeal.cli.main import main

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def no_loading(monkeypatch):
    def trap(*a, **k):
        raise AssertionError("loaded before the flags were checked")

    import zeal.cli.data
    import zeal.inference.llm

    monkeypatch.setattr(zeal.inference.llm, "load_model_and_tokenizer", trap)
    monkeypatch.setattr(zeal.cli.data, "training_blocks", trap)


@pytest.fixture
def folder(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                               "num_attention_heads": 4}))
    return d


@pytest.mark.parametrize("flags,message", [
    (["--method", "admm", "--bits", "8"], "--method admm prunes: it needs --sparsity N:M"),
    (["--method", "wanda", "--bits", "4"], "--method wanda prunes: it needs --sparsity N:M"),
    (["--sparsity", "2:4", "--lr", "nan"], "--lr must be a positive finite number, got nan"),
    (["--sparsity", "2:4", "--lr", "-1"], "--lr must be a positive finite number"),
    (["--bits", "4", "--group-size", "100"], "--group-size: weights per scale 100 does not divide the linear "
                                             "input size 64"),
    (["--sparsity", "2:4", "--group-size", "16"], "--group-size 16: applies to quantized weights: give --bits"),
    (["--sparsity", "2:3"], "--sparsity: M 3 does not divide the linear input size 64"),
])
def test_compress_flags_refused_before_loading(no_loading, folder, tmp_path, capsys, flags, message):
    assert main(["compress", "--model", str(folder), "--out", str(tmp_path / "out"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err, err


@pytest.mark.parametrize("flags,message", [
    (["--max-bytes", "100000"], "is 300000 bytes, above --max-bytes 100000"),
    (["--max-bytes", "1000000", "--seed", "-1"], "--seed: Input should be greater than or equal to 0 (got -1)"),
    (["--max-bytes", "1000000", "--seq-len", "1"], "--seq-len: Input should be greater than or equal to 2"),
])
def test_data_analyze_flags_refused_before_reading(no_loading, tmp_path, capsys, flags, message):
    corpus = tmp_path / "one_line.txt"
    corpus.write_text("x" * 300_000)  # no newline
    assert main(["data", "analyze", str(corpus), "--out", str(tmp_path / "a"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err, err


def test_expert_parallel_without_experts_is_refused():
    from pydantic import ValidationError

    from zeal.config.job import ModelSection

    with pytest.raises(ValidationError, match="model.ep_size 2 splits experts, and the model has none"):
        ModelSection(ep_size=2)
    with pytest.raises(ValidationError, match="model.ep_size 4 does not divide model.num_experts 6"):
        ModelSection(ep_size=4, num_experts=6)
    assert ModelSection(ep_size=2, num_experts=4).ep_size == 2


def test_layer_files_dtype_comes_from_a_fixed_table(tmp_path, monkeypatch):
    """The offload folder's index.json names its dtype: looked up in a table, never by
    ``getattr(torch, name)``."""
    import torch

    from zeal.inference.weight_stream import _FORMAT, LayerFiles

    monkeypatch.setattr(torch, "evil_dtype", torch.float32, raising=False)
    (tmp_path / "index.json").write_text(json.dumps({"format": _FORMAT, "dtype": "evil_dtype", "layers": []}))
    with pytest.raises(ValueError, match="index.json: unknown dtype 'evil_dtype'"):
        LayerFiles.open(tmp_path)
