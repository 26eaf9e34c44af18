"""The memory planner's formulas (zeal.zero.estimate) and `zeal estimate`."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zeal.cli.main import main
from zeal.models import GPT, GPTConfig
from zeal.zero.estimate import (
    ModelShape,
    activation_bytes,
    all_plans,
    gpt_shape,
    hf_shape,
    model_state_bytes,
    parse_bytes,
    plan,
    recommend,
)

pytestmark = pytest.mark.timeout(60)


@given(psi=st.integers(1, 10**12), n=st.integers(1, 1024))
def test_state_formulas_mixed_precision(psi, n):
    """algorithms.md §1.1: 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N (Ψ/N rounded up to whole elements)."""
    part = -(-psi // n)
    assert model_state_bytes(psi, n, 0).total == 16 * psi
    assert model_state_bytes(psi, n, 1).total == 4 * psi + 12 * part
    assert model_state_bytes(psi, n, 2).total == 2 * psi + 14 * part
    assert model_state_bytes(psi, n, 3).total == 16 * part
    s3 = model_state_bytes(psi, n, 3)
    assert (s3.params, s3.grads, s3.optimizer) == (2 * part, 2 * part, 12 * part)


@given(psi=st.integers(1, 10**12), n=st.integers(1, 1024))
def test_state_formulas_fp32(psi, n):
    """fp32 Adam, no separate master: 16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N."""
    part = -(-psi // n)
    f = [model_state_bytes(psi, n, s, mixed_precision=False).total for s in range(4)]
    assert f == [16 * psi, 8 * psi + 8 * part, 4 * psi + 12 * part, 16 * part]


@pytest.mark.parametrize("n, expected", [(4, (52.5, 41.25, 30.0)), (64, (31.4, 16.6, 1.88)),
                                         (1024, (30.1, 15.1, 0.12))])
def test_zero_paper_table_1(n, expected):
    """The ZeRO paper's Table 1 for a 7.5B model, GB (1e9 bytes)."""
    got = [model_state_bytes(7_500_000_000, n, s).total / 1e9 for s in (1, 2, 3)]
    assert got == pytest.approx(expected, rel=0.01, abs=0.01)


def test_gpt_shape_counts_the_real_model():
    for kw in ({}, {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 1000}):
        cfg = GPTConfig(n_positions=128, **kw)
        shape = gpt_shape(cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size, 128)
        assert shape.num_params == sum(p.numel() for p in GPT(cfg).parameters()) == cfg.num_parameters()


def test_hf_shape_counts_transformers_models():
    transformers = pytest.importorskip("transformers")
    cfgs = [transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64),
            transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=1000),
            transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                     num_attention_heads=4, vocab_size=500, tie_word_embeddings=False)]
    for cfg in cfgs:
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        assert hf_shape(cfg.to_dict()).num_params == sum(p.numel() for p in model.parameters()), cfg.model_type


def test_activations_formula():
    shape = ModelShape(0, n_layer=2, hidden=8, n_head=2, vocab_size=10, intermediate=32, largest_layer_params=0)
    s, b = 4, 3
    per_layer = (8 * 8 + 2 * 32) * s * b * 2  # 16·sbh values for a GPT-2 block, 2 bytes each
    head = s * b * 10 * (2 + 8) + 3 * s * b * 8 * 2
    assert activation_bytes(shape, b, s) == 2 * per_layer + head
    assert activation_bytes(shape, b, s, flash_attention=False) == 2 * (per_layer + 2 * s * s * b * 2) + head
    ckpt = activation_bytes(shape, b, s, checkpointing=True)
    assert ckpt == 2 * s * b * 8 * 2 + per_layer + head


def test_offload_moves_bytes_and_invalid_combinations_fail():
    shape = gpt_shape(4, 128, 4, 4096, 128)
    base = plan(shape, 4, 3)
    cpu = plan(shape, 4, 3, "cpu_optimizer")
    assert cpu.device == base.device - base.states.optimizer and cpu.cpu == base.states.optimizer
    nvme = plan(shape, 4, 3, "nvme_params")
    assert nvme.nvme == base.states.optimizer + base.states.params
    assert nvme.device == base.device - nvme.nvme
    with pytest.raises(ValueError, match="stage >= 1"):
        plan(shape, 4, 0, "cpu_optimizer")
    with pytest.raises(ValueError, match="stage 3"):
        plan(shape, 4, 2, "nvme_params")
    with pytest.raises(ValueError, match="offload must be"):
        plan(shape, 4, 3, "disk")


def test_recommend_picks_the_cheapest_that_fits():
    shape = gpt_shape(12, 768, 12, 50257, 1024)  # GPT-2 small
    plans = all_plans(shape, 8, micro_batch=1, seq_len=1024, checkpointing=True)
    assert recommend(plans, 10**15).label == "stage 0"
    s3 = next(p for p in plans if p.stage == 3 and p.offload == "none")
    tight = recommend(plans, s3.device)
    assert tight is not None and tight.device <= s3.device
    assert all(p.device > s3.device for p in plans[: plans.index(tight)])
    assert recommend(plans, 1) is None
    assert recommend(plans, s3.device, cpu_budget=0).offload == "none"


def test_parse_bytes():
    assert parse_bytes("16GB") == 16 * 10**9
    assert parse_bytes("1.5GiB") == int(1.5 * 2**30)
    assert parse_bytes("800M") == 800 * 2**20
    assert parse_bytes("1e9") == 10**9
    with pytest.raises(ValueError, match="--budget"):
        parse_bytes("lots")


def test_estimate_command(capsys, tmp_path):
    assert main(["estimate", "--budget", "1GiB"]) == 0
    out = capsys.readouterr().out
    for label in ("stage 0", "stage 1", "stage 2", "stage 3", "cpu optimizer", "nvme optimizer", "nvme params"):
        assert label in out
    assert "recommended for 1.00 GiB per rank: stage 0" in out
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
                               "num_hidden_layers": 32, "num_attention_heads": 32, "vocab_size": 32000,
                               "tie_word_embeddings": False}))
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                              "zero_optimization": {"stage": 3}}))
    assert main(["estimate", "--hf-config", str(cfg), "--config", str(ds), "--world-size", "8", "--seq-len", "2048",
                 "--checkpointing", "--budget", "24GB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert 6.7e9 < data["params"] < 6.8e9  # Llama-2-7B
    # 2Ψ + 2Ψ/8 ≈ 15 GB of states fits with the optimizer on CPU, which ranks before stage 3
    assert data["recommended"] == {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert main(["estimate", "--budget", "1KB"]) == 1
