"""Units behind DeepSpeed-Chat on zeal, in one process: the engine's fallback to the
model's attributes, the formerly missing DeepSpeedEngine methods (answered or refused by
name), the hybrid engine's ``generate`` against the model's own, ``compression.helper``,
and DeepSpeed's reading of ``offload_param`` below stage 3."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zeal.deepspeed as deepspeed
from zeal.deepspeed.refusals import Refused

pytestmark = pytest.mark.timeout(120)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.flag = 7

    def forward(self, x):
        return self.fc(x)

    def custom(self) -> str:
        return "model's"


def _engine(**zero):
    torch.manual_seed(0)
    model = Net()
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 0, **zero}}
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]


def test_engine_falls_back_to_the_models_attributes_as_deepspeeds():
    engine = _engine()
    assert engine.flag == 7 and engine.custom() == "model's"
    with pytest.raises(AttributeError) as e:
        _ = engine.no_such_name
    assert not isinstance(e.value, Refused)
    with pytest.raises(Refused, match="get_compile_time"):  # DeepSpeed's own names stay refused
        engine.get_compile_time()
    engine.tput_timer.update_epoch_count()
    assert engine.tput_timer.epoch_count == 1


def test_formerly_missing_engine_methods_answer_or_refuse_by_name():
    engine = _engine()
    assert engine.zero_ignore_unused_parameters() is True and engine.zero_load_from_fp32_weights() is True
    assert engine.gradient_predivide_factor() == 1.0 and engine.postscale_gradients() is True
    assert engine.managed_gradient_accumulation() is True and engine.use_node_local_storage() is False
    assert engine.is_first_weights_partition_group() is False and isinstance(engine.collect_python_gc(), int)
    for name, hint in [("checkpoint_tag_validation_enabled", "safetensors"), ("cpuadam_cores_perc", "threads"),
                       ("swap_tensor_config", "aio_config"), ("get_optimizer_configuration", "optimizer_name"),
                       ("zero_save_muon_momentum_buffer_in_memory", "Muon")]:
        with pytest.raises(Refused) as e:
            getattr(engine, name)
        assert name in str(e.value) and hint in str(e.value) and "\n" not in str(e.value)
    from zeal.deepspeed.engine import DeepSpeedEngine
    from zeal.deepspeed.refusals import deepspeed_names

    assert [n for n in deepspeed_names()["engine"] if DeepSpeedEngine.surface(n) == "missing"] == []


def test_stage3_parameters_carry_deepspeeds_markers_gathered_parameters_flips_status():
    from zeal.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    engine = _engine(stage=3)
    params = list(engine.module.parameters())
    assert [p.ds_id for p in params] == [0, 1] and params[0].ds_numel == 8
    assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in params)
    with deepspeed.zero.GatheredParameters(params):
        assert all(p.ds_status == ZeroParamStatus.AVAILABLE for p in params)
    assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in params)
    assert not hasattr(next(_engine().module.parameters()), "ds_id")  # below stage 3: none


def test_hybrid_engine_generates_as_the_model_and_restores_the_mode():
    transformers = pytest.importorskip("transformers")
    from zeal.deepspeed.hybrid_engine import DeepSpeedHybridEngine

    cfg = transformers.OPTConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2,
                                 max_position_embeddings=32, word_embed_proj_dim=16, pad_token_id=1, bos_token_id=2,
                                 eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.OPTForCausalLM(cfg)
    plain = transformers.OPTForCausalLM(cfg)
    plain.load_state_dict(model.state_dict())
    plain.eval()
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "hybrid_engine": {"enabled": True, "max_out_tokens": 64, "release_inference_cache": True}}
    engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)[0]
    assert isinstance(engine, DeepSpeedHybridEngine)
    prompt = torch.tensor([[2, 5, 9, 11]])
    engine.train()
    got = engine.module.generate(prompt, max_length=10, do_sample=False, pad_token_id=1)  # routed to the engine
    assert engine.module.training  # the caller's mode is back
    assert torch.equal(got, plain.generate(prompt, max_length=10, do_sample=False, pad_token_id=1))
    with pytest.raises(Refused, match="inference_tp_size"):
        deepspeed.initialize(model=Net(), config={**ds, "hybrid_engine": {"enabled": True, "inference_tp_size": 2}})
    with pytest.raises(ValueError, match="max_out_tokns"):
        deepspeed.initialize(model=Net(), config={**ds, "hybrid_engine": {"enabled": True, "max_out_tokns": 2}})


def test_offload_param_below_stage3_is_ignored_as_deepspeed_does():
    engine = _engine(stage=2, offload_param={"device": "cpu"})
    assert engine.zero_optimization_stage() == 2 and engine.zero_offload_param().device == "none"
    from zeal.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="needs zero_optimization.stage 3"):  # zeal's own reading keeps its error
        load_config({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})


def test_compression_helper_gets_and_sets_by_dotted_name():
    from zeal.deepspeed.compression.helper import recursive_getattr, recursive_setattr

    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2)))
    assert recursive_getattr(model, "0.0") is model[0][0]
    new = nn.Linear(2, 2)
    recursive_setattr(model, "0.0", new)
    assert model[0][0] is new
    with pytest.raises(Refused, match="compression"):
        _ = deepspeed.compression.init_compression
