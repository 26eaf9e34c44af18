"""``offload_optimizer.ratio`` (ZeRO-Offload++ partial offload): the last ``ratio`` share of the
units keeps masters, moments and update in host memory, the rest are updated beside the model.
Before, the key was accepted and did nothing (every unit was offloaded). Run on CPU with the
staging path forced on, so the device/host crossings are counted; training equals the run
without offload bit for bit (per-tensor AdamW)."""

from __future__ import annotations

import pytest
import torch

import zeal
from tests.train.models import TinyNet
from tests.zero.test_offload_staging import _train  # 3 steps of 2 micro-batches
from zeal.config import ConfigError
from zeal.zero.offload import staging as staging_mod
from zeal.zero.optimizer import hosted_units


def _engine(stage: int, offload: dict | None):
    zo: dict = {"stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 40}
    if offload is not None:
        zo["offload_optimizer"] = offload
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.05,
           "zero_optimization": zo,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1, "fused": False}}}
    torch.manual_seed(0)
    return zeal.initialize(TinyNet(), cfg)


def test_hosted_units_follow_deepspeeds_sub_group_rule():
    """Unit i is on the host when i >= int((1 - ratio) * n), as DeepSpeed assigns its
    sub-groups; ratio 1 offloads all."""
    assert hosted_units(4, 1.0) == [True] * 4
    assert hosted_units(4, 0.5) == [False, False, True, True]
    assert hosted_units(3, 0.5) == [False, True, True]  # int(1.5) = 1
    assert hosted_units(10, 0.3) == [False] * 7 + [True] * 3
    assert hosted_units(5, 0.0) == [False] * 5  # no offload section: nothing hosted


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_partial_offload_equals_no_offload_and_moves_only_hosted_units(monkeypatch, stage):
    ref = _train(_engine(stage, None))
    monkeypatch.setattr(staging_mod, "FORCE_CROSSING", True)
    engine = _engine(stage, {"device": "cpu", "ratio": 0.5})
    zopt = engine._p.zero_optimizer
    n = len(zopt.units)
    assert n >= 2, "the model must span several units for a partial split"
    hosted = zopt.hosted
    assert hosted == hosted_units(n, 0.5) and 0 < sum(hosted) < n
    k = sum(hosted)
    assert zopt.staging.stats.downloads == k  # only the hosted units' initial masters crossed
    state = _train(engine)
    # each step: one gradient download and one update upload per hosted unit, none for the others
    assert zopt.staging.stats.downloads == k + 3 * k and zopt.staging.stats.uploads == 3 * k
    for key in ref:
        assert torch.equal(state[key], ref[key]), (stage, key)


@pytest.mark.timeout(60)
def test_ratio_changes_what_crosses(monkeypatch):
    """The key has an effect: ratio 1 moves every unit, a smaller ratio fewer."""
    monkeypatch.setattr(staging_mod, "FORCE_CROSSING", True)
    full = _engine(2, {"device": "cpu"})
    part = _engine(2, {"device": "cpu", "ratio": 0.3})
    n = len(full._p.zero_optimizer.units)
    assert full._p.zero_optimizer.staging.stats.downloads == n
    assert part._p.zero_optimizer.staging.stats.downloads == sum(hosted_units(n, 0.3)) < n
    full.close()
    part.close()


def test_partial_offload_to_nvme_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="ratio 0.5 < 1 .*needs device 'cpu'") as e:
        _engine(3, {"device": "nvme", "nvme_path": str(tmp_path), "ratio": 0.5})
    assert "\n" not in str(e.value)
