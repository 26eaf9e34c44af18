"""Names DeepSpeedExamples, accelerate and TRL import from ``deepspeed`` under the switch:
DeepSpeed names zeal refuses import (scripts import them at the top and use them behind a
flag) and refuse on use in one line; DeepSpeed modules zeal lacks import as stand-ins;
``move_to_device``, ``DeepSpeedCPUAdagrad``, the ZeRO-3 leaf marks and the offload enums work.
Before: ``from deepspeed import DeepSpeedTransformerLayer`` was a bare ImportError ("cannot
import name"), ``deepspeed.ops.adagrad`` / ``runtime.zero.offload_config`` /
``runtime.sequence_parallel.ulysses_sp`` a ModuleNotFoundError."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from zeal.deepspeed.refusals import Refused

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]

SCRIPT = '''
import torch, deepspeed
from deepspeed import DeepSpeedTransformerLayer, DeepSpeedTransformerConfig, DeepSpeedConfig  # BingBert's modeling
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter  # accelerate
from deepspeed.ops.lion import DeepSpeedCPULion
import deepspeed.module_inject
from deepspeed.utils import set_z3_leaf_modules
from deepspeed.runtime.utils import move_to_device
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
def subclass():
    class Layer(DeepSpeedTransformerLayer):
        pass


out = []
for use in (lambda: DeepSpeedTransformerConfig(hidden_size=8), lambda: DeepSpeedCPULion([]),
            lambda: deepspeed.module_inject.replace_transformer_layer(None),
            subclass, lambda: UlyssesSPAttentionHF(None)):
    try:
        use()
        out.append("ran")
    except NotImplementedError as e:
        out.append(str(e))
print(out)
print([e.name for e in OffloadStateTypeEnum], OffloadDeviceEnum.cpu == "cpu")
try:
    from deepspeed.ops.not_a_module import x
except ModuleNotFoundError as e:
    print("missing:", e.name)
'''


def test_refused_names_import_and_refuse_on_use_in_one_line(tmp_path):
    script = tmp_path / "imports.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, "-m", "zeal.deepspeed", str(script)], capture_output=True, text=True,
                         timeout=100, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    uses, enums, missing = out.stdout.strip().splitlines()
    uses = eval(uses)  # noqa: S307 - our own printed list
    assert len(uses) == 5 and "ran" not in uses
    assert uses[0].startswith("deepspeed.DeepSpeedTransformerConfig (DeepSpeed 0.19) is not supported by zeal: use")
    assert "Lion" in uses[1] and "tensor_parallel.autotp_size" in uses[2] and "sequence_parallel_size" in uses[4]
    assert all("\n" not in u for u in uses)
    assert enums == "['optim_states', 'hp_params', 'lp_params', 'lp_grads', 'contiguous_grad_buffer'] True"
    assert missing == "missing: deepspeed.ops.not_a_module"  # not a DeepSpeed 0.19.8 module: a plain miss


def test_attribute_access_still_refuses_and_hasattr_is_false():
    import zeal.deepspeed as deepspeed

    with pytest.raises(Refused, match="DeepSpeedTransformerLayer"):
        _ = deepspeed.DeepSpeedTransformerLayer
    assert not hasattr(deepspeed, "replace_transformer_layer")


def test_move_to_device_moves_nested_tensors_and_in_place_under_a_criterion():
    from zeal.deepspeed.runtime.utils import move_to_device

    a, b = torch.ones(2), torch.zeros(3, dtype=torch.float16)  # .to(dtype) stands for .to(device) on CPU
    out = move_to_device({"x": [a, (b,)]}, torch.float64)
    assert out["x"][0].dtype == out["x"][1][0].dtype == torch.float64 and a.dtype == torch.float32
    same = move_to_device([a, b], torch.float64, criterion_func=lambda t: torch.is_tensor(t) and t.dtype == torch.float32)
    assert same[0] is a and a.dtype == torch.float64  # moved in place: the caller's tensor changed
    assert same[1] is not b and same[1].dtype == torch.float64 and b.dtype == torch.float16


def test_cpu_adagrad_steps_as_torch_adagrad():
    from zeal.deepspeed.ops.adagrad import DeepSpeedCPUAdagrad

    torch.manual_seed(0)
    w1 = nn.Parameter(torch.randn(4))
    w2 = nn.Parameter(w1.detach().clone())
    ours, ref = DeepSpeedCPUAdagrad([w1], lr=0.1, weight_decay=0.01), torch.optim.Adagrad([w2], lr=0.1,
                                                                                            weight_decay=0.01)
    for _ in range(3):
        for w, opt in ((w1, ours), (w2, ref)):
            (w ** 3).sum().backward()
            opt.step()
            opt.zero_grad()
    assert torch.equal(w1, w2) and not torch.equal(w1.detach(), torch.zeros(4))
    with pytest.raises(ValueError, match="fp32_optimizer_states"):
        DeepSpeedCPUAdagrad([w1], fp32_optimizer_states=False)


def test_z3_leaf_marks_as_deepspeeds():
    from zeal.deepspeed.utils import (
        get_z3_leaf_modules,
        set_z3_leaf_modules,
        set_z3_leaf_modules_by_suffix,
        unset_z3_leaf_modules,
        z3_leaf_module,
    )

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Linear(2, 2)

    model = nn.Sequential(Experts(), nn.Linear(2, 2), Experts())
    assert set_z3_leaf_modules(model, [Experts]) == [model[0], model[2]]
    assert z3_leaf_module(model[0]) and not z3_leaf_module(model[1]) and get_z3_leaf_modules(model) == [model[0],
                                                                                                         model[2]]
    assert unset_z3_leaf_modules(model, ["Experts"]) == [model[0], model[2]] and get_z3_leaf_modules(model) == []
    assert set_z3_leaf_modules_by_suffix(model, ["2.w"], raise_if_not_found=False) == ([model[2].w], [])
    with pytest.raises(ValueError, match="no module of class"):
        set_z3_leaf_modules(model, [nn.Conv1d])


@pytest.mark.parametrize("value", [True, False])
def test_gather_16bit_weights_on_model_save_reaches_the_accessor(value):
    """Hugging Face's ``save_model`` at ZeRO-3 asks the engine (through accelerate's
    ``get_state_dict``) and writes ``model.safetensors`` when it answers True; zeal dropped
    the key as "no effect", answered False, and run_clm.py saved a checkpoint folder instead."""
    import zeal.deepspeed as deepspeed

    model = nn.Linear(4, 4)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": value}},
        dist_init_required=False)
    assert engine.zero_gather_16bit_weights_on_model_save() is value
    state = engine._zero3_consolidated_16bit_state_dict()
    assert set(state) == {"weight", "bias"}


def test_load_checkpoint_leaves_the_random_generators_as_deepspeed_does(tmp_path):
    """HelloDeepSpeed's resume (dropout, NumPy-drawn masks) drew other numbers than under
    DeepSpeed: zeal's load restored the generators saved with the checkpoint; DeepSpeed saves none."""
    import random

    import numpy as np

    import zeal.deepspeed as deepspeed

    model = nn.Linear(4, 4)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, dist_init_required=False)
    engine.save_checkpoint(str(tmp_path), tag="t")
    draws = []
    for _ in range(2):
        torch.manual_seed(7)
        np.random.seed(7)
        random.seed(7)
        if draws:
            path, client = engine.load_checkpoint(str(tmp_path), tag="t")
            assert path.endswith("t") and client == {}
        draws.append((torch.rand(3).tolist(), np.random.rand(), random.random()))
    assert draws[0] == draws[1]
    assert engine.load_checkpoint(str(tmp_path / "none")) == (None, None)


def test_trl_reference_model_config_with_dotted_keys_initializes():
    """TRL's ``prepare_deepspeed`` (the DPO / GRPO reference model at ZeRO-3) copies the
    accelerate config and adds top-level keys such as ``"zero_optimization.reduce_bucket_size"``;
    DeepSpeed ignores them, zeal refused them as unknown keys. No optimizer: an eval-only engine."""
    import zeal.deepspeed as deepspeed

    model = nn.Linear(8, 8)
    ref = nn.Linear(8, 8)
    ref.load_state_dict(model.state_dict())
    engine, optimizer, *_ = deepspeed.initialize(model=model, dist_init_required=False, config={
        "train_micro_batch_size_per_gpu": 2, "train_batch_size": 2, "zero_optimization": {"stage": 3},
        "zero_optimization.reduce_bucket_size": 64, "zero_optimization.stage3_prefetch_bucket_size": 57.6})
    engine.eval()
    x = torch.ones(1, 8)
    with torch.no_grad():
        assert torch.allclose(engine(x), ref(x))


def test_an_mpu_that_restates_the_config_is_accepted_one_that_splits_by_hand_is_refused():
    """DeepSpeedExamples' AutoTP example passes ``mpu=`` beside ``tensor_parallel.autotp_size``;
    zeal refused any mpu. Now one that restates the config is checked and accepted."""
    from zeal.deepspeed.mpu import check_mpu

    class MPU:
        def __init__(self, tp: int, dp: int) -> None:
            self.tp, self.dp = tp, dp

        def get_model_parallel_world_size(self) -> int:
            return self.tp

        def get_data_parallel_world_size(self) -> int:
            return self.dp

    check_mpu(MPU(2, 1), {"tensor_parallel": {"autotp_size": 2}, "data_parallel_size": 1})
    from zeal.config import load_config

    assert load_config({"train_batch_size": 2, "tensor_parallel": {"autotp_size": 2}, "data_parallel_size": 1})
    check_mpu(MPU(1, 2), {})
    with pytest.raises(ValueError, match="tensor-parallel size 2 .* config 1 .*split by hand"):
        check_mpu(MPU(2, 1), {"train_batch_size": 2})
