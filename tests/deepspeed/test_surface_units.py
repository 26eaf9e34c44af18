"""DeepSpeed's API on zeal, in-process: each name behaves as DeepSpeed 0.19 documents it
(checked against torch, a formula or DeepSpeed's documented values)."""

from __future__ import annotations

import argparse
import logging
import math
import random

import pytest
import torch
from torch import nn

import zeal.deepspeed as deepspeed

pytestmark = pytest.mark.timeout(60)


def test_add_config_arguments_adds_deepspeeds_flags():
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert args.deepspeed is True and args.deepspeed_config == "ds.json"
    assert args.deepscale is False and args.deepscale_config is None
    assert parser.parse_args([]).deepspeed is False


def test_accelerator_on_cpu_answers_as_deepspeeds_cpu_accelerator(monkeypatch):
    from zeal.deepspeed.accelerator import Accelerator

    monkeypatch.setenv("LOCAL_RANK", "3")
    acc = Accelerator("cpu")
    assert acc.device_name() == "cpu" and acc.device_name(1) == "cpu" and acc.current_device_name() == "cpu"
    assert acc.current_device() == 3 and acc.is_available() and acc.communication_backend_name() == "gloo"
    assert acc.on_accelerator(torch.zeros(1)) and acc.is_bf16_supported() and acc.is_fp16_supported()
    t = torch.ones(2)
    assert acc.pin_memory(t) is t and not acc.is_pinned(t)
    assert acc.total_memory() > acc.available_memory() > 0 and acc.memory_allocated() > 0
    assert acc.max_memory_allocated() >= acc.memory_allocated() * 0.5
    acc.manual_seed(5)
    a = torch.rand(3)
    acc.manual_seed_all(5)
    assert torch.equal(a, torch.rand(3))  # the CPU generator was seeded
    acc.synchronize(), acc.empty_cache(), acc.set_device(0)
    with pytest.raises(NotImplementedError, match="create_op_builder"):
        acc.create_op_builder("CPUAdamBuilder")
    monkeypatch.setenv("LOCAL_SIZE", "2")
    assert acc.device_count() == 2


def test_accelerator_refuses_an_unknown_ds_accelerator(monkeypatch):
    from zeal.deepspeed.accelerator import Accelerator

    monkeypatch.setenv("DS_ACCELERATOR", "hpu")
    with pytest.raises(ValueError, match="DS_ACCELERATOR='hpu'"):
        Accelerator()


def test_set_random_seed_seeds_random_numpy_and_torch():
    np = pytest.importorskip("numpy")
    from zeal.deepspeed.runtime.utils import set_random_seed

    set_random_seed(2**32 + 7)  # numpy takes the seed mod 2**32, as in DeepSpeed
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    set_random_seed(2**32 + 7)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first
    np.random.seed(7)
    assert np.random.rand() == first[1]


def test_repeating_loader_restarts_and_sets_the_epoch():
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    from zeal.deepspeed.utils import RepeatingLoader

    data = list(range(4))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = RepeatingLoader(DataLoader(data, batch_size=2, sampler=sampler))
    got = [next(loader).tolist() for _ in range(4)]
    expect = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        expect += [b.tolist() for b in DataLoader(data, batch_size=2, sampler=sampler)]
    assert got == expect and loader.epoch == 1


def test_log_dist_logs_alone_and_on_named_ranks(caplog):
    from zeal.deepspeed.utils import log_dist, logger

    logger.propagate = True
    try:
        with caplog.at_level(logging.INFO, logger="DeepSpeed"):
            log_dist("hello", ranks=[0])
            log_dist("quiet", ranks=[1], level=logging.DEBUG)
        assert any("hello" in r.message for r in caplog.records)
        assert not any("quiet" in r.message for r in caplog.records)
    finally:
        logger.propagate = False


def test_moe_param_groups_split_experts_apart():
    from zeal.deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

    moe = deepspeed.moe.layer.MoE(hidden_size=8, expert=nn.Linear(8, 8), num_experts=2, k=1)
    params = list(moe.parameters())
    groups = split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "p", "lr": 0.1})
    assert [g["name"] for g in groups] == ["p", "p_moe"] and groups[1]["moe"] is True
    assert all(is_moe_param(p) for p in groups[1]["params"]) and not any(is_moe_param(p) for p in groups[0]["params"])
    assert len(groups[0]["params"]) + len(groups[1]["params"]) == len(params) and groups[1]["lr"] == 0.1


@pytest.mark.parametrize("wmode", [True, False])
def test_fused_and_cpu_adam_step_as_adamw_or_adam_l2(wmode):
    from zeal.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    torch.manual_seed(0)
    w0, g = torch.randn(5), torch.randn(5)
    ref_cls = torch.optim.AdamW if wmode else torch.optim.Adam
    results = []
    for make in (lambda p: FusedAdam(p, lr=0.1, weight_decay=0.5, adam_w_mode=wmode),
                 lambda p: DeepSpeedCPUAdam(p, lr=0.1, weight_decay=0.5, adamw_mode=wmode),
                 lambda p: ref_cls(p, lr=0.1, weight_decay=0.5)):
        p = nn.Parameter(w0.clone())
        opt = make([p])
        for _ in range(3):
            p.grad = g.clone()
            opt.step()
        results.append(p.detach())
    torch.testing.assert_close(results[0], results[2]), torch.testing.assert_close(results[1], results[2])
    with pytest.raises(ValueError, match="bias_correction=False"):
        FusedAdam([nn.Parameter(w0)], bias_correction=False)


def test_lr_schedule_classes_follow_deepspeeds_formulas():
    from zeal.deepspeed.runtime.lr_schedules import WarmupDecayLR, WarmupLR

    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    s = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=10)
    lrs = [s.get_lr()[0]]
    for _ in range(12):
        s.step()
        lrs.append(s.get_last_lr()[0])
    assert lrs[0] == 0.0 and lrs[11] == pytest.approx(0.1)
    # log warm-up: after k steps last_batch_iteration is k - 1, lr = log(k)/log(N)
    assert lrs[3] == pytest.approx(0.1 * math.log(3) / math.log(10))
    d = WarmupDecayLR(opt, total_num_steps=20, warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear")
    for _ in range(15):
        d.step()
    assert d.get_lr()[0] == pytest.approx(0.1 * (20 - 14) / (20 - 10))  # last_batch_iteration 14
    assert d.state_dict()["last_step"] == 15


def test_zero_names_scripts_import():
    from zeal.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    assert ZeroParamStatus.NOT_AVAILABLE.value == 2 and deepspeed.zero.Init and deepspeed.zero.GatheredParameters
    p = nn.Parameter(torch.zeros(2))
    assert [q for q in [p] if hasattr(q, "ds_id") and q.ds_status == ZeroParamStatus.NOT_AVAILABLE] == []
    with deepspeed.zero.Init():
        m = nn.Linear(2, 2)
    assert m.weight.is_meta


def test_top_level_refusals_are_one_line_and_hasattr_is_false():
    with pytest.raises(NotImplementedError, match=r"deepspeed.init_inference .* zeal.LLM"):
        _ = deepspeed.init_inference
    assert not hasattr(deepspeed, "DeepSpeedTransformerLayer")
    with pytest.raises(AttributeError, match="no attribute 'not_a_deepspeed_name'") as e:
        _ = deepspeed.not_a_deepspeed_name
    assert not isinstance(e.value, NotImplementedError)
    assert deepspeed.__version__.startswith("0.19.8") and deepspeed.comm.ReduceOp is torch.distributed.ReduceOp


def test_pipeline_module_takes_deepspeeds_argument_order_and_ties_within_a_stage():
    from zeal.deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    def head(module, x):
        return x @ module.weight.T  # the tied embedding used as an output layer

    torch.manual_seed(0)
    layers = [TiedLayerSpec("emb", nn.Embedding, 10, 4), LayerSpec(nn.Linear, 4, 4),
              TiedLayerSpec("emb", nn.Embedding, 10, 4, forward_fn=head)]
    model = PipelineModule(layers, 1, loss_fn=nn.CrossEntropyLoss())  # num_stages second, as DeepSpeed's
    assert model.num_stages == 1 and model.stage_id == 0
    assert sum(p.numel() for p in model.parameters()) == 10 * 4 + 4 * 4 + 4  # the tied weight counted once
    ids = torch.tensor([[1, 2]])
    out = model(ids)
    emb = model.layers[0]
    torch.testing.assert_close(out, model.layers[1](emb(ids)) @ emb.weight.T)
    assert out.shape == (1, 2, 10)
    with pytest.raises(ValueError, match="topology"):
        PipelineModule(layers, topology=object())


def test_pipeline_module_refuses_a_tie_across_stages(monkeypatch):
    from zeal.deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    layers = [TiedLayerSpec("emb", nn.Linear, 4, 4), LayerSpec(nn.Linear, 4, 4), LayerSpec(nn.Linear, 4, 4),
              TiedLayerSpec("emb", nn.Linear, 4, 4)]
    with pytest.raises(ValueError, match=r"TiedLayerSpec 'emb' spans pipeline stages \[0, 1\]"):
        PipelineModule(layers, num_stages=2, partition_method="uniform")


def test_engine_surface_names_are_real_zeal_engine_attributes():
    from zeal.deepspeed.engine import _DELEGATED, _ZERO_FIELDS
    from zeal.pipe.engine import PipelineEngine
    from zeal.train.engine import TrainEngine

    for name in _DELEGATED - {"is_first_stage", "is_last_stage"}:
        assert hasattr(TrainEngine, name) or name in TrainEngine.__init__.__code__.co_names or name in (
            "optimizer", "lr_scheduler", "global_steps", "global_samples", "micro_steps", "mesh", "tensor_parallel"), name
    assert hasattr(PipelineEngine, "is_first_stage") and hasattr(PipelineEngine, "is_last_stage")
    from zeal.config.schema import ZeroConfig

    for field in _ZERO_FIELDS.values():
        assert field in ZeroConfig.model_fields, field


def test_every_public_name_of_deepspeeds_dir_is_implemented_or_refused_by_name():
    from zeal.deepspeed.refusals import Refused, deepspeed_names

    missing = []
    for name in deepspeed_names()["top_level"]:  # dir(deepspeed) of DeepSpeed 0.19.8 (bench/compat/ds_surface.py)
        try:
            getattr(deepspeed, name)
        except Refused as e:
            if e.generic:
                missing.append(name)
    assert missing == []
    assert {"constants", "git_version_info", "QUERY", "KV"} <= deepspeed_names()["top_level"]
    assert deepspeed.constants.TORCH_DISTRIBUTED_DEFAULT_PORT == deepspeed.TORCH_DISTRIBUTED_DEFAULT_PORT == 29500
    assert (deepspeed.constants.CROSS_RANK, deepspeed.constants.LOCAL_RANK) == ("CROSS_RANK", "LOCAL_RANK")
    assert deepspeed.git_version_info.version == deepspeed.__version__ and deepspeed.git_version_info.installed_ops == {}
    assert (deepspeed.QUERY, deepspeed.KV, deepspeed.NOT_HEAD_BLOCKED) == ("query", "kv", "not-head-blocked")
