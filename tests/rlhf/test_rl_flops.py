"""``tflops`` / ``mfu`` of a GRPO step (zeal.rlhf.flops): the forward count equals torch's
FLOP counter on a real forward (linear layers, attention's matmuls, the LM head on the
answer positions only); a step's training count is 3 forwards (+1 with a reference), the
shared-prompt count runs each group's prompt once; a GRPO run logs the columns."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from zeal.rlhf.flops import StepFlops
from zeal.rlhf.hybrid import Rollout

pytestmark = pytest.mark.timeout(60)


def _tiny():
    from zeal.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def test_forward_count_equals_torchs_flop_counter():
    """Linear layers and head: torch's counter on zeal's forward (it does not see the CPU
    attention kernels); attention: torch's counter on attention's two matmuls at the model's
    shapes (scores q·kᵀ, then weights·v), once per layer."""
    model = _tiny()
    fl = StepFlops(model)
    h, hd = 4, 8
    for T, answer in ((12, 5), (20, 20)):
        ids = torch.randint(0, 96, (1, T))
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            model(ids, logits_index=torch.arange(T - answer, T))
        q = torch.randn(1, h, T, hd)
        with FlopCounterMode(display=False) as fa:
            torch.softmax(q @ q.transpose(-1, -2), -1) @ q
        want = fc.get_total_flops() + 2 * fa.get_total_flops()
        assert fl.forward(T, T, answer) == pytest.approx(want, rel=1e-9), T


def test_grpo_step_count():
    fl = StepFlops(_tiny())
    fl.peak = 1e12
    ros = [Rollout([1] * 6, [2] * n, [0.0] * n, group=g) for g, n in ((0, 3), (0, 4), (1, 2), (1, 5))]
    answers = sum(fl.forward(len(r.output_ids), 6 + len(r.output_ids), len(r.output_ids)) for r in ros)
    full = sum(fl.forward(6 + len(r.output_ids), 6 + len(r.output_ids), len(r.output_ids)) for r in ros)
    gen = 2 * fl.forward(6, 6, 1) + answers
    shared = fl.grpo(ros, True, False, 1.0, 2.0, 4.0)
    assert shared["tflops_train"] * 1e12 == pytest.approx(3 * (2 * fl.forward(6, 6, 0) + answers) / 2.0)
    assert shared["tflops_generate"] * 1e12 == pytest.approx(gen)
    rows = fl.grpo(ros, False, True, 1.0, 2.0, 4.0)  # full rows, and the reference's forward
    assert rows["tflops_train"] * 1e12 == pytest.approx(4 * full / 2.0)
    assert rows["tflops"] * 1e12 == pytest.approx((gen + 4 * full) / 4.0) and rows["mfu"] == rows["tflops"]


def test_grpo_logs_tflops_and_mfu(tmp_path):
    from zeal.rlhf import grpo

    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    cfg = {"rlhf": {"steps": 1, "batch_size": 2, "num_generations": 2, "max_new_tokens": 3, "beta": 0.04,
                    "generation_dtype": "fp32"}}
    res = grpo(_tiny(), lambda p, c, **k: [0.0] * len(c), prompts, cfg, eos_token_ids=[0], out=str(tmp_path))
    m = res.metrics[0]
    assert m["tflops"] > 0 and 0 < m["mfu"] < 1 and m["tflops_train"] > 0 and m["tflops_generate"] > 0
    assert "tflops" in (tmp_path / "metrics.csv").read_text().splitlines()[0].split(",")


class _Counted:
    """Torch's FLOP counter around calls of a function (a list of each call's total)."""

    def __init__(self, fn):
        self.fn, self.counts = fn, []

    def __call__(self, *args, **kwargs):
        with FlopCounterMode(display=False) as fc:
            out = self.fn(*args, **kwargs)
        self.counts.append(fc.get_total_flops())
        return out


def test_ppo_train_count_equals_torchs_flop_counter(monkeypatch):
    """A real PPO iteration (2 epochs, PPO-ptx rows, a reward model) under torch's counter:
    the logged training FLOPs (``tflops_train`` × ``time_train_s``) equal what the counter saw
    in the update (actor, reference, critic, ptx; forward and backward) and the reward
    model's forward. Rows without padding; attention left out of both (the counter does not
    see the CPU attention kernels; its term is checked by the forward test above)."""
    import zeal.rlhf.flops as flops_mod
    import zeal.rlhf.ppo_trainer as pt
    from zeal.rlhf import ppo
    from zeal.rlhf.value import ValueModel

    monkeypatch.setattr(flops_mod, "attention_shape", lambda model: (0, 0))
    update = _Counted(pt.ppo_update)
    monkeypatch.setattr(pt, "ppo_update", update)
    reward_counts = []

    class CountedReward(ValueModel):
        def forward(self, ids):
            with FlopCounterMode(display=False) as fc:
                out = super().forward(ids)
            reward_counts.append(fc.get_total_flops())
            return out

    rm = CountedReward(_tiny())
    torch.manual_seed(1)
    torch.nn.init.normal_(rm.v_head.weight, std=0.02)
    cfg = {"rlhf": {"steps": 1, "batch_size": 4, "max_new_tokens": 4, "ppo_epochs": 2, "unsup_coef": 0.5,
                    "generation_dtype": "fp32"}}
    prompts = [[5, 6, 7], [8, 9, 10], [11, 12, 13], [14, 15, 16]]  # one length: no padding; no end token
    res = ppo(_tiny(), rm, prompts, cfg, unsup_data=[[1, 2, 3, 4, 5]] * 4)
    m = res.metrics[0]
    assert m["response_length"] == 4
    logged = m["tflops_train"] * 1e12 * m["time_train_s"]
    assert logged == pytest.approx(update.counts[0] + reward_counts[0], rel=1e-9)
    assert 0 < m["mfu"] < 1 and m["tflops_generate"] > 0 and m["tflops"] > 0


def test_dpo_step_count_equals_torchs_flop_counter(monkeypatch, tmp_path):
    """A whole DPO run of one step over every pair under torch's counter: the reference's
    log-probs (one forward of every row, before training) plus the step (forward and
    backward of the same rows) are 4 forwards, the step's logged FLOPs 3 of them; and
    ``tflops`` / ``mfu`` reach metrics.csv."""
    import zeal.rlhf.flops as flops_mod
    from zeal.rlhf import dpo

    monkeypatch.setattr(flops_mod, "attention_shape", lambda model: (0, 0))
    rows = [{"prompt": [5, 6, 7], "chosen": [8, 9], "rejected": [10, 11]},
            {"prompt": [12, 13, 14], "chosen": [15, 16], "rejected": [17, 18]}]
    with FlopCounterMode(display=False) as fc:
        res = dpo(_tiny(), rows, {"rlhf": {"steps": 1, "batch_size": 2}}, out=str(tmp_path))
    m = res.metrics[0]
    assert m["tflops"] * 1e12 * m["time_train_s"] == pytest.approx(0.75 * fc.get_total_flops(), rel=1e-9)
    assert 0 < m["mfu"] < 1
    header = (tmp_path / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "tflops" in header and "mfu" in header
