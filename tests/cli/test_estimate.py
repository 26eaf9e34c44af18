"""The memory planner's formulas (zeal.zero.estimate) and `zeal estimate`."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zeal.cli.main import main
from zeal.models import GPT, GPTConfig
from zeal.zero import estimate
from zeal.zero.estimate import (
    ModelShape,
    activation_bytes,
    activation_parts,
    all_plans,
    block_saved_bytes,
    candidate_plans,
    gpt_shape,
    hf_shape,
    micro_batch_choices,
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
    """Kept + transient, term by term (the old formula had no fp32 copy of bf16 logits, no
    LayerNorm/attention statistics and no block backward; it was the activation part of the bug)."""
    shape = ModelShape(0, n_layer=2, hidden=8, n_head=2, vocab_size=10, intermediate=32, largest_layer_params=0)
    s, b, c = 4, 3, 2
    block = (8 * 8 + 2 * 32 + 4) * s * b * c + 4 * 2 * s * b  # values in bf16, log-sum-exp in fp32
    assert block_saved_bytes(shape, b, s, c) == block
    assert block_saved_bytes(shape, b, s, c, flash_attention=False) == block + 2 * s * s * b * c
    head_kept = 2 * s * b * 8 * c + 4 * s * b * 10
    loss = s * b * 10 * (2 * c + 4)  # logits, shifted copy, fp32 copy
    assert activation_parts(shape, b, s, c) == (2 * block + head_kept, loss)
    kept, transient = activation_parts(shape, b, s, c, checkpointing=True)
    # block inputs and the head's inputs only: the loss is scored in recomputed chunks
    assert kept == 2 * s * b * 8 * c + 2 * s * b * 8 * c
    backward = block + 2 * s * b * 32 * c + 10 * 8 * c  # recomputed block, MLP gradients, tied embedding gradient
    ck_head, ck_loss = 2 * s * b * 8 * c, s * b * 10 * (c + 4 + 8)  # one chunk: logits, fp32 copy, log-softmax, grad
    assert transient == max(ck_loss, backward - ck_head)
    assert activation_bytes(shape, b, s, c, checkpointing=True) == kept + transient


def test_block_constant_is_what_autograd_saves():
    """block_saved_bytes equals the storages saved_tensors_hooks sees in one zeal GPT block."""
    import torch

    b, s, h, n_head = 2, 16, 32, 4
    for dtype, c in ((torch.float32, 4), (torch.bfloat16, 2)):
        model = GPT(GPTConfig(vocab_size=64, n_positions=s, n_embd=h, n_layer=1, n_head=n_head)).to(dtype)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen: dict[int, int] = {}

        def pack(t, seen=seen, params=params):
            if t.untyped_storage().data_ptr() not in params:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        x = torch.randn(b, s, h, dtype=dtype, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.transformer.h[0](x)
        shape = gpt_shape(1, h, n_head, 64, s)
        assert sum(seen.values()) == block_saved_bytes(shape, b, s, c), dtype


def test_checkpointing_and_precision():
    shape = gpt_shape(12, 768, 12, 4096, 1024)  # 12 layers, small vocabulary: blocks dominate
    off, on = (activation_bytes(shape, 4, 1024, 2, checkpointing=ck) for ck in (False, True))
    assert off >= 3 * on
    # with GPT-2's vocabulary too: the loss's logits are scored in checkpointed chunks
    gpt2 = gpt_shape(12, 768, 12, 50257, 1024)
    assert activation_bytes(gpt2, 4, 1024, 2) >= 3 * activation_bytes(gpt2, 4, 1024, 2, checkpointing=True)
    # bf16 halves the values; the attention log-sum-exp stays fp32, and so does the loss's transient
    lse = 4 * 12 * 1024 * 4
    assert block_saved_bytes(shape, 4, 1024, 2) - lse == (block_saved_bytes(shape, 4, 1024, 4) - lse) // 2
    assert activation_parts(gpt2, 4, 1024, 2)[1] == activation_parts(gpt2, 4, 1024, 4)[1] == 8 * 4 * 1024 * 50257


def test_working_parts_per_stage():
    shape = gpt_shape(8, 512, 8, 4096, 256)
    p = {s: plan(shape, 2, s, micro_batch=8, seq_len=256, mixed_precision=False) for s in range(4)}
    assert p[0].grad_buffers == p[1].grad_buffers == 0 < p[2].grad_buffers
    assert p[3].gathered > 0 == p[2].gathered
    assert p[0].step_temporaries == 0  # fp32 updates from the reduced buffer
    assert p[1].step_temporaries == 4 * -(-shape.num_params // 2)  # the reduce-scatter output
    bf = plan(shape, 2, 0, mixed_precision=True)
    assert bf.step_temporaries == 4 * shape.num_params  # fp32 copy of the whole gradient
    assert p[0].slack == estimate.HOST_HEAP_SLACK_BYTES and p[3].slack == 0
    tiny = gpt_shape(2, 64, 2, 256, 32)  # a step that frees less than the measured slack is charged that
    small = plan(tiny, 2, 0, micro_batch=1, seq_len=32, mixed_precision=False)
    assert small.slack == small.activations + 4 * tiny.num_params < estimate.HOST_HEAP_SLACK_BYTES
    gpu = plan(shape, 2, 0, micro_batch=8, seq_len=256, mixed_precision=False, host=False)
    assert gpu.baseline == gpu.slack == 0
    assert p[0].device - gpu.device == estimate.HOST_BASELINE_BYTES + estimate.HOST_HEAP_SLACK_BYTES
    for q in p.values():
        fwd = q.activations + q.grad_buffers + q.gathered
        assert q.device == q.baseline + q.slack + q.states.total + max(fwd, q.step_temporaries + q.grad_buffers)


def test_planner_defaults_follow_zeal():
    from zeal.config.schema import ZeroConfig
    from zeal.zero.units import COALESCE_BLOCK_ELEMS

    zc = ZeroConfig()
    assert estimate.BUCKET_ELEMS == zc.reduce_bucket_size
    assert estimate.PREFETCH_ELEMS == zc.stage3_prefetch_bucket_size
    assert estimate.COALESCE_BLOCK_ELEMS == COALESCE_BLOCK_ELEMS
    from zeal.models.checkpointing import LOSS_CHUNK_ELEMS

    assert estimate.LOSS_CHUNK_ELEMS == LOSS_CHUNK_ELEMS


def test_offload_moves_bytes_and_invalid_combinations_fail():
    shape = gpt_shape(4, 128, 4, 4096, 128)
    base = plan(shape, 4, 3)
    cpu = plan(shape, 4, 3, "cpu_optimizer")
    # the step (and its fp32 gradient copy) runs where the optimizer state is
    assert cpu.device == base.device - base.states.optimizer
    assert cpu.cpu == base.states.optimizer + base.step_temporaries
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


def test_budget_search():
    shape = gpt_shape(12, 768, 12, 50257, 1024)
    kw = dict(seq_len=1024, mixed_precision=True)
    plans = candidate_plans(shape, 2, 8, **kw)
    assert len(plans) == 10 * 2 * 4  # stage/offload x checkpointing x micro-batch 8, 4, 2, 1
    assert (plans[0].stage, plans[0].checkpointing, plans[0].micro_batch) == (0, False, 8)
    assert recommend(plans, 10**15) is plans[0]
    # just below stage 2's micro-batch 8 without checkpointing: a smaller micro-batch, still no checkpointing
    s2 = plan(shape, 2, 2, micro_batch=8, **kw)
    best = recommend(plans, s2.device - 1)
    assert not best.checkpointing and best.micro_batch < 8 and best.device < s2.device
    # below every plan without checkpointing at micro-batch 1 in the cheapest tier: checkpointing, largest micro-batch
    floor = min(plan(shape, 2, s, micro_batch=1, **kw).device for s in (0, 1, 2))
    best = recommend(plans, floor - 1)
    assert best.checkpointing and best.stage <= 2 and best.offload == "none"
    assert best.micro_batch == max(p.micro_batch for p in plans
                                   if p.checkpointing and p.offload == "none" and p.stage <= 2 and p.device < floor)
    cfg = best.ds_config()
    assert cfg["train_micro_batch_size_per_gpu"] == best.micro_batch
    assert cfg["activation_checkpointing"] == {"number_checkpoints": 12}
    assert "activation_checkpointing" not in plans[0].ds_config()
    assert micro_batch_choices(8) == [8, 4, 2, 1] and micro_batch_choices(6) == [6, 4, 2, 1]


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
    # 16Ψ/8 ≈ 13.5 GB of states: plain stage 3 fits 24 GB once the activations (10 GB at 2048 tokens
    # without checkpointing) are checkpointed; stage 2 + CPU optimizer fits too, but has more moving parts
    # (the optimizer steps on the CPU): stage 3 wins
    assert data["recommended"] == {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                                   "activation_checkpointing": {"number_checkpoints": 32}}
    both = [p for p in data["plans"] if (p["stage"], p["offload"]) in ((2, "cpu_optimizer"), (3, "none"))]
    assert len(both) == 2 and all(p["device"] <= 24e9 for p in both)  # both fit
    columns = {"activations", "activations_kept", "grad_buffers", "gathered", "step_temporaries", "baseline",
               "slack", "device", "checkpointing", "micro_batch"}
    assert all(columns <= set(p) for p in data["plans"]) and columns <= set(data["recommended_plan"])
    assert main(["estimate", "--budget", "1KB"]) == 1


# The default `zeal train` job (docs/default_job.md): SmolLM2-135M-Instruct's config.json, and the peak
# RSS per rank its summary.json reported (max over its 2 ranks) over 4 training seeds, on 2 CPU cores
# (/work/scratch-first/s4/seeds.sh: `zeal train`, `zeal train --seed 1|2|3`).
SMOLLM2_CONFIG = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                  "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                  "tie_word_embeddings": True}
DEFAULT_JOB_PEAK_MIB = (1975.2, 2003.0)  # lowest and highest rank peak; zeal estimate: 1745.8


def test_estimate_of_the_default_job_is_within_15_percent_of_its_measured_peak(capsys, tmp_path):
    """`zeal estimate --hf-config smollm2 --micro-batch 2` (the README's command for the default
    job) against the peaks measured; the job's settings are checked to be the ones measured, so a
    change of the default job asks for a new measurement here."""
    from zeal.config.job import SMOLLM2_HIDDEN_SIZE, JobSpec, default_engine_config

    spec = JobSpec()
    engine = default_engine_config(spec.job)
    assert (spec.job.hf_model, spec.job.nproc, spec.data.seq_len, engine["train_micro_batch_size_per_gpu"],
            engine["zero_optimization"]["stage"]) == ("smollm2", 2, 128, 2, 3)
    assert SMOLLM2_CONFIG["hidden_size"] == SMOLLM2_HIDDEN_SIZE
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(SMOLLM2_CONFIG))
    assert main(["estimate", "--hf-config", str(cfg), "--micro-batch", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["params"] == 134_515_008  # the job's "134.52M params"
    stage3 = next(p for p in data["plans"] if (p["stage"], p["offload"]) == (3, "none"))
    for measured in DEFAULT_JOB_PEAK_MIB:
        assert abs(stage3["device"] / 2**20 - measured) <= 0.15 * measured, (stage3["device"] / 2**20, measured)
