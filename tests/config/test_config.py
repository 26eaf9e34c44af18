"""Every class of bad config fails at start-up with a message naming the key and rule."""

from __future__ import annotations

import json

import pytest

import zeal
from zeal.config import AutoValues, ConfigError, load_config
from zeal.models import GPT, GPTConfig


def _msg(cfg) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    return str(e.value)


def test_unknown_key_names_its_path():
    assert "zero_optimization.stgae" in _msg({"zero_optimization": {"stgae": 2}})
    assert "unknown key" in _msg({"train_batchsize": 2})


def test_wrong_type_names_key_and_value():
    m = _msg({"zero_optimization": {"stage": "two"}})
    assert "zero_optimization.stage" in m and "'two'" in m
    assert "zero_optimization.stage" in _msg({"zero_optimization": {"stage": 5}})
    assert "gradient_clipping" in _msg({"gradient_clipping": -1})


def test_batch_arithmetic():
    cfg = load_config({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4})
    with pytest.raises(ValueError, match=r"train_batch_size 16 != micro 2 × accum 4 × world 1"):
        cfg.resolve_batch(1)
    with pytest.raises(ValueError, match="not divisible by micro 3 × world 2"):
        load_config({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 3}).resolve_batch(2)
    assert load_config({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}).resolve_batch(2) == (16, 2, 4)
    assert load_config({"train_batch_size": 16, "gradient_accumulation_steps": 2}).resolve_batch(2) == (16, 4, 2)
    assert load_config({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4}).resolve_batch(2) == (8, 4, 1)


def test_initialize_reports_batch_rule():
    with pytest.raises(ConfigError, match="train_batch_size 16 != micro 2 × accum 4 × world 1"):
        zeal.initialize(GPT(GPTConfig(vocab_size=32, n_embd=16, n_layer=1, n_head=2, n_positions=8)),
                        {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
                         "gradient_accumulation_steps": 4})


def test_known_but_unsupported_keys_say_so():
    assert "does not support pipeline parallelism" in _msg({"pipeline": {"stages": 2}})
    assert "does not support row pruning" in _msg(
        {"compression_training": {"row_pruning": {"shared_parameters": {"enabled": True}}}})
    # an explicitly disabled unsupported feature is harmless
    load_config({"flops_profiler": {"enabled": False}})


def test_harmless_deepspeed_keys_are_accepted():
    cfg = load_config({"zero_allow_untested_optimizer": True, "optimizer": {"type": "Adam", "params": {"lr": "auto"}},
                       "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "overlap_comm": True}},
                      AutoValues(lr=1e-3, hidden_size=100))
    assert cfg.optimizer.type == "AdamW"  # DeepSpeed's Adam is decoupled unless adam_w_mode is false
    assert cfg.zero_optimization.reduce_bucket_size == 100 * 100  # "auto": Hugging Face's h*h
    assert load_config({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}).optimizer.type == "Adam"


def test_invalid_combinations():
    assert "choose one" in _msg({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert "needs zero_optimization.stage 3" in _msg({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    assert "nvme_path is required" in _msg({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}})


def test_optimizer_and_scheduler_errors():
    model = GPT(GPTConfig(vocab_size=32, n_embd=16, n_layer=1, n_head=2, n_positions=8))
    with pytest.raises(ConfigError, match="optimizer.type"):
        zeal.initialize(model, {"optimizer": {"type": "NoSuchOpt"}})
    with pytest.raises(ConfigError, match="optimizer.params"):
        zeal.initialize(GPT(GPTConfig(vocab_size=32, n_embd=16, n_layer=1, n_head=2, n_positions=8)),
                        {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "betas": [0.9, 0.9]}}})
    with pytest.raises(ConfigError, match="scheduler.params.warmup_steps"):
        zeal.initialize(GPT(GPTConfig(vocab_size=32, n_embd=16, n_layer=1, n_head=2, n_positions=8)),
                        {"scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 3}}})
    with pytest.raises(ConfigError, match="total_num_steps"):
        zeal.initialize(GPT(GPTConfig(vocab_size=32, n_embd=16, n_layer=1, n_head=2, n_positions=8)),
                        {"scheduler": {"type": "WarmupDecayLR", "params": {}}})


def test_files_json_and_yaml(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    assert load_config(tmp_path / "c.json").zero_optimization.stage == 3
    (tmp_path / "c.yaml").write_text("zero_optimization:\n  stage: 2\nbf16:\n  enabled: true\n")
    cfg = load_config(str(tmp_path / "c.yaml"))
    assert cfg.zero_optimization.stage == 2 and cfg.bf16.enabled
    (tmp_path / "bad.json").write_text("{not json")
    assert "not valid json" in _msg(tmp_path / "bad.json")
    assert "does not exist" in _msg(tmp_path / "missing.json")
