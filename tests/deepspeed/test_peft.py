"""A PEFT-wrapped model (``peft.get_peft_model``, what TRL passes) through
``deepspeed.initialize`` and through the Trainer's ``deepspeed=`` path: only the adapters
train, the frozen base stays bit-equal, a checkpoint resumes, and the losses equal the same
loop in plain PyTorch (one process, full batch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_harness import free_port, run_ranks
from tests.needs import needs

pytestmark = [needs("peft"), pytest.mark.timeout(400)]
ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def _result(cmd: list[str], cwd: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("ZEAL_DEEPSPEED", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **extra)
    proc = subprocess.run([sys.executable, *cmd], env=env, capture_output=True, text=True, timeout=350, cwd=str(cwd))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1].split(" ", 1)[1])


def _reference(rank: int, world: int, out: str, ref_world: int) -> dict:
    """The script's ``--reference`` (plain PyTorch, one process) in a process forked from the
    harness's warm server: the reference needs no interpreter of its own."""
    import runpy

    os.environ["REF_WORLD"] = str(ref_world)
    sys.argv = [str(SCRIPTS / "peft_ds.py"), "--out", out, "--reference"]
    return runpy.run_path(sys.argv[0], run_name="peft_reference")["result"]


def _initialize(tmp_path: Path, stage: int, ranks: int) -> dict:
    script = [str(SCRIPTS / "peft_ds.py"), "--out", str(tmp_path / "ckpt"), "--stage", str(stage)]
    if ranks == 1:
        return _result(["-m", "zeal.deepspeed", *script], tmp_path)
    return _result(["-m", "zeal.cli.main", "deepspeed", "--num_gpus", str(ranks), "--master_port", str(free_port()),
                    *script], tmp_path)


@pytest.mark.parametrize(("stage", "ranks"), [(3, 1), pytest.param(0, 1, marks=pytest.mark.slow),
                                              pytest.param(3, 2, marks=pytest.mark.slow),
                                              pytest.param(2, 2, marks=pytest.mark.slow)])
def test_peft_model_through_initialize_trains_only_the_adapters(tmp_path, stage, ranks):
    got = _initialize(tmp_path, stage, ranks)
    ref = run_ranks(_reference, 1, str(tmp_path), ranks, timeout=120)[0]
    assert got["stage"] == stage and got["world"] == ranks
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert len(set(ref["losses"])) > 1  # the adapters move the loss (lora_B starts non-zero)
    assert got["resumed"] == pytest.approx(got["losses"][3:], rel=1e-6)
    assert got["loaded"] and got["base_moved"] is False
    assert len(got["trainable"]) == 8 and all(".lora_" in n for n in got["trainable"])


def _trainer(tmp_path: Path, name: str, *args: str) -> dict:
    out = tmp_path / name
    cmd = [str(SCRIPTS / "hf_trainer_ds.py"), "--out", str(out), "--peft", *args]
    return _result(cmd if "--no-deepspeed" in args else ["-m", "zeal.deepspeed", *cmd], tmp_path)


@pytest.mark.slow  # the default tier: test_load_checkpoint_not_strict_loads_a_frozen_base_model
@pytest.mark.parametrize("stage", [3, 0, 2])
def test_peft_model_through_the_trainer_deepspeed_path(tmp_path, stage):
    full = _trainer(tmp_path, "full", "--stage", str(stage))
    plain = _trainer(tmp_path, "plain", "--no-deepspeed")
    assert full["stage"] == stage and full["base_moved"] is False
    assert all(".lora_" in n for n in full["trainable"]) and len(full["trainable"]) == 8
    assert [full["losses"][k] for k in sorted(full["losses"])] == pytest.approx(
        [plain["losses"][k] for k in sorted(plain["losses"])], rel=1e-5)
    resumed = _trainer(tmp_path, "full", "--stage", str(stage), "--resume", str(tmp_path / "full" / "checkpoint-2"))
    for step in ("3", "4"):
        assert resumed["losses"][step] == pytest.approx(full["losses"][step], rel=1e-6)


def test_load_checkpoint_not_strict_loads_a_frozen_base_model(tmp_path):
    """The Trainer resumes a PEFT model with ``load_checkpoint(load_module_strict=False)``;
    zeal refused it. Frozen base + trainable adapter, ZeRO-3 on one process."""
    import torch
    from torch import nn

    import zeal.deepspeed as deepspeed

    def build() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        model[0].requires_grad_(False)
        return model

    config = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3}}
    model = build()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=config, dist_init_required=False)
    x = torch.ones(2, 4)
    engine.backward(engine(x).sum())
    engine.step()
    engine.save_checkpoint(str(tmp_path))
    saved = {k: v.clone() for k, v in engine.state_dict().items()}
    fresh_model = build()
    fresh, *_ = deepspeed.initialize(model=fresh_model, config=config, dist_init_required=False,
                                     model_parameters=[p for p in fresh_model.parameters() if p.requires_grad])
    path, _ = fresh.load_checkpoint(str(tmp_path), load_module_strict=False)
    assert path is not None and fresh.global_steps == 1
    assert all(torch.equal(v, saved[k]) for k, v in fresh.state_dict().items())
    assert not torch.equal(saved["module.1.weight"], build()[1].weight.detach())  # the adapter stepped
