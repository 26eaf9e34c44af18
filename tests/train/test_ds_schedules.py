"""DeepSpeed's OneCycle and LRRangeTest schedules (pure functions, and built from config)."""

from __future__ import annotations

import pytest
import torch

from zeal.train.lr_schedules import OneCycle, build_scheduler, lr_range_test_lr

pytestmark = pytest.mark.timeout(60)


def test_one_cycle_rises_falls_then_decays():
    c = OneCycle(cycle_min_lr=0.01, cycle_max_lr=0.11, cycle_first_step_size=10, decay_lr_rate=0.5,
                 decay_step_size=2, cycle_min_mom=0.8, cycle_max_mom=0.9)
    assert c.lr(0) == pytest.approx(0.01) and c.lr(5) == pytest.approx(0.06) and c.lr(10) == pytest.approx(0.11)
    assert c.lr(15) == pytest.approx(0.06) and c.lr(19) == pytest.approx(0.02)  # second half = first by default
    assert c.lr(20) == pytest.approx(0.01)  # DeepSpeed: the cycle ends at batch index 19
    assert c.lr(21) == pytest.approx(0.01 / (1 + 0.5 * 0.5)) and c.lr(22) == pytest.approx(0.01 / 1.5)
    assert c.momentum(1) == pytest.approx(0.89) and c.momentum(10) == pytest.approx(0.8)  # opposite to the LR
    assert c.momentum(0) == pytest.approx(0.8)  # DeepSpeed starts Adam's beta1 at cycle_min_mom
    stairs = OneCycle(cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_first_step_size=10, cycle_first_stair_count=2)
    assert [stairs.lr(s) for s in (0, 4, 5, 9, 10)] == pytest.approx([0.0, 0.0, 0.5, 0.5, 1.0])


def test_lr_range_test_grows_linearly_or_in_stairs():
    assert lr_range_test_lr(0, 1e-3, 10, 2.0) == pytest.approx(1e-3)
    assert lr_range_test_lr(5, 1e-3, 10, 2.0) == pytest.approx(2e-3)
    assert lr_range_test_lr(5, 1e-3, 10, 2.0, True) == pytest.approx(1e-3)


def test_built_from_config_and_cycles_adam_beta1():
    opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = build_scheduler("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_first_step_size": 2}, opt)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1) and opt.param_groups[0]["betas"] == pytest.approx((0.8, 0.99))
    sched.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1.0) and opt.param_groups[0]["betas"][0] == pytest.approx(0.8)
    build_scheduler("LRRangeTest", {"lr_range_test_min_lr": 1e-4}, opt)
    with pytest.raises(ValueError, match="cycle_max_lr"):
        build_scheduler("OneCycle", {"cycle_min_lr": 0.1}, opt)
