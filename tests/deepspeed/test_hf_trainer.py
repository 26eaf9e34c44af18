"""Hugging Face's DeepSpeed path on zeal: an unchanged ``transformers.Trainer`` script with
``TrainingArguments(deepspeed=...)`` trains under the switch, saves Hugging Face's checkpoint
folders (``checkpoint-N/global_stepN``) and resumes from them with the losses of an
uninterrupted run; plus the ``deepspeed`` pieces transformers and accelerate call."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.dist_harness import free_port

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "hf_trainer_ds.py"


def _run(out: Path, *args: str, ranks: int = 1, plain: bool = False) -> dict:
    """The script under the switch: ``python -m zeal.deepspeed`` on one rank, ``ZEAL_DEEPSPEED=1
    torchrun`` on more; ``plain``: no switch and no DeepSpeed (the Trainer's own loop)."""
    from zeal.deepspeed.switch import site_dir

    env = {k: v for k, v in os.environ.items() if k not in ("ZEAL_DEEPSPEED", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    argv = [str(SCRIPT), "--out", str(out), *args]
    if plain:
        cmd = [sys.executable, *argv, "--no-deepspeed"]
    elif ranks == 1:
        cmd = [sys.executable, "-m", "zeal.deepspeed", *argv]
    else:
        env.update(ZEAL_DEEPSPEED="1", PYTHONPATH=site_dir() + os.pathsep + str(ROOT))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
               str(free_port()), *argv]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=500, cwd=str(out.parent))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    got = json.loads(line.split(" ", 1)[1])
    if isinstance(got["losses"], dict):
        got["losses"] = {int(k): v for k, v in got["losses"].items()}
    return got


def _train_then_resume(tmp_path: Path, *args: str, ranks: int = 1) -> tuple[dict, dict]:
    full = _run(tmp_path / "full", *args, ranks=ranks)
    shutil.copytree(tmp_path / "full" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    resumed = _run(tmp_path / "resumed", *args, "--resume", str(tmp_path / "resumed" / "checkpoint-2"), ranks=ranks)
    return full, resumed


def _check(full: dict, resumed: dict, stage: int) -> None:
    assert full["engine"] == "zeal.deepspeed.engine" and full["stage"] == stage
    assert sorted(full["losses"]) == [1, 2, 3, 4]
    assert {"global_step2", "latest", "trainer_state.json"} <= set(full["checkpoint"])
    for step in (3, 4):  # after the resume: the uninterrupted run's losses (same process order, same values)
        assert resumed["losses"][step] == pytest.approx(full["losses"][step], rel=1e-6, abs=0)


def test_trainer_with_deepspeed_config_trains_saves_and_resumes_zero3(tmp_path):
    full, resumed = _train_then_resume(tmp_path, "--stage", "3")
    _check(full, resumed, 3)


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "ranks", "extra"), [(2, 1, ()), (2, 2, ()), (3, 2, ()),
                                                       (2, 2, ("--ds-optimizer",))])
def test_trainer_with_deepspeed_config_resumes(tmp_path, stage, ranks, extra):
    full, resumed = _train_then_resume(tmp_path, "--stage", str(stage), *extra, ranks=ranks)
    _check(full, resumed, stage)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_with_deepspeed_config_matches_the_plain_trainer(tmp_path, stage):
    """The same script without DeepSpeed (Trainer's own AdamW, schedule and clipping):
    fp32, one rank, the same losses to float rounding."""
    zeal_run = _run(tmp_path / "zeal", "--stage", str(stage))
    plain = _run(tmp_path / "plain", plain=True)
    for step, loss in plain["losses"].items():
        assert zeal_run["losses"][step] == pytest.approx(loss, rel=1e-5)


# -- the pieces transformers and accelerate call, in process ----------------------------------------

def _engine(stage: int):
    import zeal.deepspeed as deepspeed

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": float("inf"),  # accelerate's "never"
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, config_params=config, dist_init_required=False)
    return engine, config


def _step(engine) -> None:
    loss = engine(torch.ones(2, 4)).square().mean()
    engine.backward(loss)
    engine.step()


def test_engine_config_is_the_dict_given_and_zero3_consolidates_the_state():
    engine, config = _engine(3)
    assert engine.config is config and engine.config.get("zero_optimization", {}).get("stage") == 3
    _step(engine)
    sd = engine._zero3_consolidated_16bit_state_dict()
    full = engine.module_state_dict()
    assert list(sd) == list(engine.module.state_dict()) and all(torch.equal(sd[k], full[k]) for k in full)
    engine2, _ = _engine(2)
    with pytest.raises(ValueError, match="ZeRO-3"):
        engine2._zero3_consolidated_16bit_state_dict()


def test_save_checkpoint_to_an_existing_tag_replaces_it_and_zero_to_fp32_reads_it(tmp_path):
    from zeal.deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    engine, _ = _engine(3)
    engine.save_checkpoint(str(tmp_path), tag="global_step0")
    _step(engine)
    engine.save_checkpoint(str(tmp_path), tag="global_step0")  # as the Trainer does under ZeRO-3: replaced
    assert sorted(os.listdir(tmp_path)) == ["global_step0", "latest"]
    got = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    full = engine.module_state_dict()
    assert set(got) == set(full) and all(torch.equal(got[k], full[k]) for k in full)
    engine2, _ = _engine(3)  # a fresh model loads what the second save holds
    path, _ = engine2.load_checkpoint(str(tmp_path))
    assert path.endswith("global_step0")
    assert all(torch.equal(v, full[k]) for k, v in engine2.module_state_dict().items())


def test_clone_tensors_for_torch_save_copies_nested_tensors():
    from zeal.deepspeed.checkpoint.utils import clone_tensors_for_torch_save

    base = torch.arange(6.0)
    item = {"a": base[:2], "b": [base[2:4], (base[4:], 3)], "c": "x"}
    out = clone_tensors_for_torch_save(item)
    assert out["c"] == "x" and out["b"][1][1] == 3 and isinstance(out["b"][1], tuple)
    assert torch.equal(out["b"][0], base[2:4]) and out["a"].untyped_storage().nbytes() == 8  # no view of base
    base.zero_()
    assert out["a"].tolist() == [0.0, 1.0]


# -- accelerate's DeepSpeed plugin -------------------------------------------------------------------

def _run_accelerate(out: Path, stage: int, ranks: int) -> dict:
    global SCRIPT
    saved, SCRIPT = SCRIPT, SCRIPT.parent / "accelerate_ds.py"
    try:
        out.mkdir(parents=True)
        return _run(out, "--stage", str(stage), ranks=ranks)
    finally:
        SCRIPT = saved


@pytest.mark.parametrize(("stage", "ranks"), [(2, 1)])
def test_accelerate_deepspeed_plugin_trains_like_plain_pytorch_and_reloads_its_state(tmp_path, stage, ranks):
    got = _run_accelerate(tmp_path / "run", stage, ranks)
    assert got["engine"] == "zeal.deepspeed.engine" and got["stage"] == stage
    assert got["losses"] == pytest.approx(got["reference"], rel=1e-5)  # fp32: one process, the global batch
    assert got["again"] == pytest.approx(got["losses"][3:], rel=1e-6)  # after load_state of step 3's state
