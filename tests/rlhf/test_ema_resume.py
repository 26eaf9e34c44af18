"""The PPO actor's EMA is saved with every checkpoint and restored on resume: a run stopped
after 2 steps and resumed to 4 ends with the same EMA as a run of 4 steps straight (not an
average restarted from the resumed weights)."""

import pytest
import torch

from tests.rlhf.test_e2e import PROMPTS, fraction_of_target, tiny

pytestmark = pytest.mark.timeout(90)


def _cfg(steps):
    return {"optimizer": {"type": "AdamW", "params": {"lr": 3e-2}},
            "rlhf": {"steps": steps, "batch_size": 4, "max_new_tokens": 4, "ema": 0.5, "critic_lr": 1e-2,
                     "save_every": 2}}


def test_ema_survives_resume(tmp_path):
    from zeal.rlhf import ppo

    straight = ppo(tiny(), fraction_of_target, PROMPTS, _cfg(4), out=str(tmp_path / "a"))
    ppo(tiny(), fraction_of_target, PROMPTS, _cfg(2), out=str(tmp_path / "b"))
    assert (tmp_path / "b" / "checkpoints" / "ema" / "step2.safetensors").exists()
    resumed = ppo(tiny(), fraction_of_target, PROMPTS, _cfg(4), out=str(tmp_path / "b"))
    assert [r["step"] for r in resumed.metrics] == [3, 4]
    want, got = straight.extra["ema"].params, resumed.extra["ema"].params
    actor = {k: v.detach().float() for k, v in straight.engine.module.state_dict().items() if k in want}
    # the two runs trained the same weights; the EMA lags them (so a restarted average would differ)
    for name, w in resumed.engine.module.state_dict().items():
        if name in want:
            assert torch.allclose(w.float(), actor[name], atol=1e-6), name
    assert max((want[k] - actor[k]).abs().max().item() for k in want) > 1e-3
    for k in want:
        assert torch.allclose(got[k], want[k], atol=1e-6), k
