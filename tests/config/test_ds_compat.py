"""DeepSpeed keys: aliases translated, no-ops accepted (said once), missing features
refused by name, "auto" resolved as the Hugging Face integration resolves it."""

from __future__ import annotations

import json
import logging

import pytest

from zeal.config import AutoValues, ConfigError, load_config
from zeal.config.ds_compat import NO_EFFECT, UNSUPPORTED, translate

pytestmark = pytest.mark.timeout(60)


def _msg(cfg: dict, auto: AutoValues | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(cfg, auto)
    return str(e.value)


def test_keys_deepspeed_accepts_that_zeal_used_to_refuse():
    cfg = load_config({
        "bfloat16": {"enabled": True, "loss_scale": 1.0},
        "zero_optimization": {"stage": 3, "memory_efficient_linear": False, "sub_group_size": 0,
                              "stage3_gather_16bit_weights_on_model_save": "auto"},
        "seq_parallel_communication_data_type": "bf16", "checkpoint": {"load_universal": True},
        "data_types": {"grad_accum_dtype": "fp32"}, "compile": {"disable": False, "backend": "inductor"},
        "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}},
    })
    assert cfg.bf16.enabled and cfg.zero_optimization.stage == 3 and cfg.scheduler.type == "OneCycle"
    assert load_config({"bf16": {"enabled": True, "loss_scale": 0, "auto_cast": False}}).bf16.enabled


def test_deepspeed_short_names_of_stage3_keys_are_aliases():
    z = load_config({"zero_optimization": {"stage": 3, "prefetch_bucket_size": 123, "max_live_parameters": 7,
                                           "param_persistence_threshold": 5, "max_reuse_distance": 0,
                                           "gather_16bit_weights_on_model_save": True}}).zero_optimization
    assert (z.stage3_prefetch_bucket_size, z.stage3_max_live_parameters, z.stage3_param_persistence_threshold,
            z.stage3_max_reuse_distance) == (123, 7, 5, 0)
    # zeal's own spelling wins over the alias, key by key
    assert load_config({"bfloat16": {"enabled": False}, "bf16": {"enabled": True}}).bf16.enabled


def test_no_effect_keys_are_said_once(caplog):
    caplog.set_level(logging.INFO, logger="zeal")
    cfg = {"zero_optimization": {"stage": 2, "round_robin_gradients": True}, "comms_logger": {"enabled": False}}
    load_config(cfg)
    load_config(cfg)
    said = [r.message for r in caplog.records if "round_robin_gradients" in r.message]
    assert len(said) <= 1  # once per process (an earlier test may have said it already)


@pytest.mark.parametrize("cfg, feature", [
    ({"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}}, "1-bit Adam"),
    ({"optimizer": {"type": "OneBitLamb", "params": {"lr": 1e-3}}}, "1-bit LAMB"),
    ({"optimizer": {"type": "ZeroOneAdam", "params": {"lr": 1e-3}}}, "0/1 Adam"),
    ({"sequence_parallel": {"size": 2, "mode": "ring"}}, "sequence parallelism 'ring'"),
    ({"communication_data_type": "fp16"}, "communication dtype"),
    ({"gradient_allreduce_op": "sum"}, "summed gradients"),
    ({"compile": {"deepcompile": True}}, "DeepCompile"),
    ({"zero_optimization": {"stage": 3, "mics_shard_size": 8}}, "MiCS"),
    ({"fp8": {"enabled": True}}, "fp8"),
    ({"amp": {"enabled": True}}, "apex AMP"),
    ({"scheduler": {"type": "CyclicLR", "params": {}}}, "scheduler.type"),
])
def test_missing_features_are_refused_by_name(cfg, feature):
    msg = _msg(cfg)
    assert feature in msg and "unknown key" not in msg


def test_disabled_or_default_valued_features_pass():
    load_config({"tensor_parallel": {"autotp_size": 1}, "sequence_parallel_size": 1, "gradient_allreduce_op": "mean",
                 "flops_profiler": {"enabled": False}, "communication_data_type": None,
                 "zero_optimization": {"mics_shard_size": -1, "zeropp_loco_param": None}})


def test_every_table_entry_is_handled():
    for path in NO_EFFECT:  # each no-op path is removed from a config that has it
        cfg: dict = {}
        node = cfg
        *heads, leaf = path.split(".")
        for h in heads:
            node = node.setdefault(h, {})
        node[leaf] = {} if leaf in ("tensorboard", "wandb", "compile") else True
        out, _ = translate(cfg, AutoValues())
        assert leaf not in json.dumps(out), path
    assert all(isinstance(v, tuple) and len(v) == 2 for v in UNSUPPORTED.values())


def test_auto_takes_the_jobs_values_or_hf_defaults_or_names_the_key():
    auto = AutoValues(micro_batch=4, grad_accum=2, lr=3e-4, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1,
                      gradient_clipping=0.5, fp16=False, bf16=True, warmup_steps=7, total_steps=70, hidden_size=64)
    cfg = load_config({
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                          "warmup_num_steps": "auto", "total_num_steps": "auto"}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto"}}, auto)
    assert cfg.resolve_batch(2) == (16, 4, 2) and cfg.gradient_clipping == 0.5 and cfg.bf16.enabled
    assert cfg.optimizer.params == {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1}
    assert cfg.scheduler.params == {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4, "warmup_num_steps": 7,
                                    "total_num_steps": 70}
    z = cfg.zero_optimization  # Hugging Face: h*h, 0.9*h*h, 10*h
    assert (z.reduce_bucket_size, z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold) == \
        (4096, 3686, 640)
    assert auto.resolved["optimizer.params.lr"] == 3e-4
    # nothing given: Hugging Face's defaults where it has them ...
    bare = load_config({"gradient_clipping": "auto", "bf16": {"enabled": "auto"},
                        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": "auto"}},
                        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}})
    assert bare.gradient_clipping == 1.0 and not bare.bf16.enabled
    assert bare.optimizer.params["betas"] == [0.9, 0.999] and bare.scheduler.params["warmup_max_lr"] == 1e-3
    # ... and a one-line error naming the key otherwise
    assert "'optimizer.params.lr' is \"auto\"" in _msg({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})
    assert "'scheduler.params.total_num_steps'" in _msg(
        {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}})
    assert "'train_micro_batch_size_per_gpu'" in _msg({"train_micro_batch_size_per_gpu": "auto"})
    assert "'zero_optimization.reduce_bucket_size'" in _msg({"zero_optimization": {"reduce_bucket_size": "auto"}})
    # the other two batch keys give the third
    assert load_config({"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto",
                        "gradient_accumulation_steps": 2}).resolve_batch(2) == (16, 4, 2)


def test_zeal_train_resolves_auto_from_its_flags_and_saves_it(tmp_path):
    from zeal.cli.main import build_parser
    from zeal.cli.train import build_spec

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                     "warmup_num_steps": "auto"}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"}}))
    parser, _ = build_parser("train")
    args, extra = parser.parse_known_args(["train", "--config", str(ds), "--lr", "2e-3", "--grad-accum", "3",
                                           "--steps", "50", "--precision", "fp32", "--model", "gpt"])
    e = build_spec(args, extra).engine
    assert "auto" not in json.dumps(e)
    assert e["train_micro_batch_size_per_gpu"] == 8 and e["gradient_accumulation_steps"] == 3  # default, flag
    assert e["optimizer"]["params"] == {"lr": 2e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    assert e["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-3, "warmup_num_steps": 30}
    assert e["gradient_clipping"] == 1.0 and e["fp16"]["enabled"] is False and e["bf16"]["enabled"] is False
    assert e["zero_optimization"]["reduce_bucket_size"] == 128 * 128  # the default GPT's n_embd


def test_autotp_size_is_honoured():
    assert load_config({"tensor_parallel": {"autotp_size": 2}}).tensor_parallel.autotp_size == 2
    assert load_config({}).tensor_parallel.autotp_size == 1


def test_sequence_parallel_size_and_llamafactory_section_are_read():
    assert load_config({"sequence_parallel_size": 4}).sequence_parallel_size == 4
    sec = {"enabled": True, "size": 2, "mode": "ulysses", "ulysses": {"degree": 2}}
    assert load_config({"sequence_parallel": sec}).sequence_parallel_size == 2
    assert load_config({"sequence_parallel": {"enabled": False, "size": 8}}).sequence_parallel_size == 1
    with pytest.raises(ConfigError, match="disagrees"):
        load_config({"sequence_parallel": {"size": 2}, "sequence_parallel_size": 4})
    both = load_config({"sequence_parallel_size": 2, "pipeline_parallel": {"size": 2}})  # PP x SP composes
    assert (both.sequence_parallel_size, both.pipeline_parallel.size) == (2, 2)
