"""``import zeal.deepspeed as deepspeed``: a DeepSpeed-style script (tests/deepspeed/
ds_style_script.py) runs unchanged on 1 and 2 gloo ranks at ZeRO stages 0 and 3."""

from __future__ import annotations

import pytest
import torch

from tests.dist_harness import run_ranks

pytestmark = pytest.mark.timeout(300)


def _ds_config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 4}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                              "stage3_gather_16bit_weights_on_model_save": True},
    }


def _rank(rank: int, world: int, stage: int, out_dir: str) -> dict:
    from tests.deepspeed.ds_style_script import main

    return main(_ds_config(stage), out_dir)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [0, 3])
def test_deepspeed_script_runs_unchanged(tmp_path, stage, world):
    results = run_ranks(_rank, world, stage, str(tmp_path), timeout=240)
    r = results[0]
    assert r["global_steps"] == 5 and r["stage"] == stage and r["module"] == "Net"
    assert r["train_batch_size"] == 2 * 2 * world and r["boundary"] is False  # next micro-step starts a step
    assert r["after"] == pytest.approx(r["replay"], rel=1e-5)  # resumed from the checkpoint, same losses
    assert r["client_state"] == {"step": 3} and r["path"].endswith("step3")
    assert all(x == x for x in r["first"])
    assert len(r["lr"]) == 1 and r["scheduler"] == "StepScheduler"
    for out in results:  # rank 0's change reached every rank
        assert torch.allclose(torch.as_tensor(out["bias"]), torch.full((4,), 0.5))
    state = torch.load(tmp_path / "model.bin", weights_only=True)
    assert set(state) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"} and state["fc1.weight"].shape == (32, 16)


def test_initialize_takes_param_groups_and_returns_the_4_tuple():
    import zeal.deepspeed as deepspeed
    from tests.deepspeed.ds_style_script import Net

    model = Net()
    groups = [{"params": [model.fc1.weight, model.fc2.weight], "weight_decay": 0.1},
              {"params": [model.fc1.bias, model.fc2.bias], "weight_decay": 0.0}]
    engine, opt, loader, sched = deepspeed.initialize(model=model, model_parameters=groups, config={
        "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
        dist_init_required=False)  # no process group in the test process
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert loader is None and sched is None and engine.gradient_accumulation_steps() == 1
    engine.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the warning is about CPU runs")
def test_fp16_on_cpu_says_it_is_emulated(caplog):
    import zeal
    from tests.deepspeed.ds_style_script import Net

    engine = zeal.initialize(model=Net(), config={"train_batch_size": 2, "fp16": {"enabled": True}})
    assert any("fp16 is emulated on CPU" in r.message and "bf16" in r.message for r in caplog.records)
    engine.close()
