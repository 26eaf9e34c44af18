"""The GRPO loss family (zeal.rlhf.grpo_losses): each loss type on a hand-worked example
and against TRL's formula re-derived here on the same tensors (values and gradients to
1e-6); the rollout/trainer mismatch weights against their formula; the trainer applying
them."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from zeal.rlhf import grpo_losses as gl

# the hand-worked batch: old log-probs 0, so log-prob = log(ratio); row 1's last token is padding
RATIOS = torch.tensor([[1.0, 1.5, 0.5], [1.1, 0.7, 1.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ADV = torch.tensor([1.0, -1.0])


def _hand(loss_type, **kw):
    lp = RATIOS.log().requires_grad_(True)
    loss, met = gl.policy_loss(lp, torch.zeros(2, 3), ADV, MASK, loss_type=loss_type, **kw)
    loss.backward()
    return loss.item(), met, lp.grad


def test_hand_worked_ppo_style_losses():
    # per token -min(r·A, clip(r, 0.8, 1.2)·A): row 0 (A=+1) -1, -1.2, -0.5; row 1 (A=-1) 1.1, 0.8
    row0, row1 = -1.0 - 1.2 - 0.5, 1.1 + 0.8
    assert _hand("grpo")[0] == pytest.approx((row0 / 3 + row1 / 2) / 2, abs=1e-6)
    assert _hand("sequence")[0] == pytest.approx((row0 / 3 + row1 / 2) / 2, abs=1e-6)  # zeal's old name
    assert _hand("bnpo")[0] == pytest.approx((row0 + row1) / 5, abs=1e-6)
    assert _hand("token")[0] == pytest.approx((row0 + row1) / 5, abs=1e-6)
    assert _hand("dr_grpo", max_completion_length=4)[0] == pytest.approx((row0 + row1) / (2 * 4), abs=1e-6)
    assert _hand("dapo")[0] == pytest.approx((row0 + row1) / 5, abs=1e-6)
    loss, met, grad = _hand("dapo", num_items=10)
    assert loss == pytest.approx((row0 + row1) / 10, abs=1e-6)
    # clipped (no gradient): row 0 token 1 (r 1.5 > 1.2, A > 0) and row 1 token 1 (r 0.7 < 0.8, A < 0)
    assert met["clip_ratio_high"] == pytest.approx(1 / 5) and met["clip_ratio_low"] == pytest.approx(1 / 5)
    assert met["clip_ratio_region"] == pytest.approx(2 / 5)
    # d/dlogπ of −r·A = −r·A/10 where not clipped; padding and clipped tokens: 0
    want = torch.tensor([[-1.0, 0.0, -0.5], [1.1, 0.0, 0.0]]) / 10
    torch.testing.assert_close(grad, want, rtol=0, atol=1e-7)
    # clip-higher: ε_high 0.6 leaves r 1.5 unclipped
    assert _hand("bnpo", eps_high=0.6)[0] == pytest.approx((-1.0 - 1.5 - 0.5 + row1) / 5, abs=1e-6)


def test_hand_worked_gspo_and_cispo():
    s0 = math.exp((math.log(1.0) + math.log(1.5) + math.log(0.5)) / 3)  # 0.9086: inside [0.8, 1.2]
    s1 = math.exp((math.log(1.1) + math.log(0.7)) / 2)  # 0.8775
    loss, met, _ = _hand("gspo")
    assert loss == pytest.approx((-s0 + s1) / 2, abs=1e-6)
    assert met["clip_ratio_region"] == 0.0
    # the sequence level of the token ratios, explicitly, gives the same as gspo
    assert _hand("grpo", importance_sampling_level="sequence")[0] == pytest.approx(loss, abs=1e-7)
    # cispo, ε_max 1.3: −sg(min(r, 1.3))·A·logπ summed / 5 tokens
    loss, met, grad = _hand("cispo", eps_high=1.3)
    terms = [-1.0 * math.log(1.0), -1.3 * math.log(1.5), -0.5 * math.log(0.5), 1.1 * math.log(1.1), 0.7 * math.log(0.7)]
    assert loss == pytest.approx(sum(terms) / 5, abs=1e-6)
    assert met["cispo_clip_ratio"] == pytest.approx(1 / 5)
    torch.testing.assert_close(grad, torch.tensor([[-1.0, -1.3, -0.5], [1.1, 0.7, 0.0]]) / 5, rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="eps_high"):
        _hand("cispo")
    with pytest.raises(ValueError, match="loss_type"):
        _hand("ppo")


def _trl(lp, old, adv, mask, loss_type, level, eps_low, eps_high, ref, beta, isw, max_len, num_items):
    """TRL GRPOTrainer._compute_loss, re-derived: the log importance weight per token or the
    masked mean per sequence, coef_1/coef_2, the per-token loss, the vLLM IS ratio, then
    β·k3, then the loss type's aggregation."""
    log_ratio = lp - old
    if level == "sequence":
        liw = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        liw = log_ratio
    coef_1 = torch.exp(liw)
    a = adv.unsqueeze(1)
    if loss_type == "cispo":
        per = -torch.clamp(coef_1, max=eps_high).detach() * a * lp
    else:
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        per = -torch.min(coef_1 * a, coef_2 * a)
    if isw is not None:
        per = per * isw
    if beta:
        per = per + beta * (torch.exp(ref - lp) - (ref - lp) - 1)
    if loss_type == "grpo":
        return ((per * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per * mask).sum() / (per.size(0) * max_len)
    return (per * mask).sum() / torch.as_tensor(num_items).clamp(min=1.0)  # dapo, cispo


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "gspo", "cispo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_each_loss_equals_trl_formula(loss_type, level):
    g = torch.Generator().manual_seed(3)
    B, T = 6, 7
    lens = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lens[:, None]).float()
    old = -torch.rand(B, T, generator=g) * 3
    lp0 = old + torch.randn(B, T, generator=g) * 0.3
    ref = old + torch.randn(B, T, generator=g) * 0.2
    adv = torch.randn(B, generator=g)
    isw = torch.rand(B, T, generator=g) * 2
    eps_high = 5.0 if loss_type == "cispo" else 0.28
    trl_type, trl_level = ("grpo", "sequence") if loss_type == "gspo" else (loss_type, level)
    for beta, w in ((0.0, None), (0.04, isw)):
        lp_a = lp0.clone().requires_grad_(True)
        lp_b = lp0.clone().requires_grad_(True)
        ours, _ = gl.policy_loss(lp_a, old, adv, mask, loss_type=loss_type, importance_sampling_level=level,
                                 eps_low=0.2, eps_high=eps_high, ref_logprobs=ref, beta=beta, is_weights=w,
                                 max_completion_length=T + 3, num_items=17.0)
        theirs = _trl(lp_b, old, adv, mask, trl_type, trl_level, 0.2, eps_high, ref, beta, w, T + 3, 17.0)
        ours.backward()
        theirs.backward()
        assert abs(ours.item() - theirs.item()) < 1e-6
        torch.testing.assert_close(lp_a.grad, lp_b.grad, rtol=0, atol=1e-6)


def test_mismatch_weights_against_formula():
    trainer = torch.tensor([[0.1, 2.0, -0.5, 9.0]])
    gen = torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the padding's exponent counts as 0
    e = math.exp
    tok = gl.mismatch_weights(trainer, gen, mask, "token_truncate", clip_max=3.0)
    torch.testing.assert_close(tok, torch.tensor([[e(0.1), 3.0, e(-0.5), 1.0]]))
    tok = gl.mismatch_weights(trainer, gen, mask, "token_truncate", clip_max=3.0, clip_min=0.7)
    torch.testing.assert_close(tok, torch.tensor([[e(0.1), 3.0, 0.7, 1.0]]))
    tok = gl.mismatch_weights(trainer, gen, mask, "token_mask", clip_max=3.0)
    torch.testing.assert_close(tok, torch.tensor([[e(0.1), 0.0, e(-0.5), 1.0]]))
    seq = gl.mismatch_weights(trainer, gen, mask, "sequence_truncate", clip_max=3.0)  # e^1.6 = 4.95 > 3
    torch.testing.assert_close(seq, torch.tensor([[3.0]]))
    assert gl.mismatch_weights(trainer, gen, mask, "sequence_mask", clip_max=3.0).item() == 0.0
    assert gl.mismatch_weights(trainer, gen, mask, "sequence_mask", clip_max=5.0).item() == pytest.approx(e(1.6))
    assert gl.mismatch_weights(trainer, gen, mask, "token_truncate", clip_max=None)[0, 1] == pytest.approx(e(2.0))
    with pytest.raises(ValueError, match="importance_sampling_mode"):
        gl.mismatch_weights(trainer, gen, mask, "token_clip")


def test_high_entropy_mask_keeps_the_top_quantile():
    ent = torch.tensor([[0.1, 0.9, 0.5, 7.0], [0.3, 0.7, 0.2, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])  # 7.0 is padding
    keep = gl.high_entropy_mask(ent, mask, 0.25)  # 7 tokens: the 0.75 quantile is 0.6
    torch.testing.assert_close(keep, torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]))
    assert gl.high_entropy_mask(ent, mask, 1.0).sum() == mask.sum()


def _rollouts(model):
    from zeal.rlhf.batch import pack, policy_logprobs
    from zeal.rlhf.hybrid import Rollout

    g = torch.Generator().manual_seed(5)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    rollouts = [Rollout(p, torch.randint(0, 64, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist(),
                        [], group=k) for k, p in enumerate(prompts) for _ in range(2)]
    b = pack([r.prompt_ids for r in rollouts], [r.output_ids for r in rollouts], 0)
    with torch.no_grad():
        lp = policy_logprobs(model, b.ids)
    return rollouts, [row[m.bool()].tolist() for row, m in zip(lp, b.mask)]


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_trainer_weights_tokens_by_the_truncated_mismatch_ratio(loss_type):
    """A generator whose log-probs sit 0.05 below the trainer's (as a bf16 copy's may):
    every weight is e^0.05 (or the cap), and at ratio 1 the loss scales by it."""
    import zeal
    from tests.rlhf.test_hybrid import CFG, tiny_llama
    from zeal.rlhf.config import RLHFConfig
    from zeal.rlhf.grpo_trainer import _train_on

    model = tiny_llama()
    rollouts, lps = _rollouts(model)
    for r, row in zip(rollouts, lps):
        r.logprobs = [x - 0.05 for x in row]
    cfg = {**CFG, "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 0}}
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    stats = {}
    for name, kw in (("off", {"importance_sampling_correction": False}), ("on", {}),
                     ("capped", {"importance_sampling_cap": 1.02})):
        rc = RLHFConfig(num_generations=2, beta=0.0, loss_type=loss_type, **kw)
        engine = zeal.initialize(copy.deepcopy(model), cfg)
        stats[name] = _train_on(engine, None, rollouts, rewards, 0, rc, exact=False)
        engine.close()
    assert "is_ratio_mean" not in stats["off"]
    assert stats["on"]["is_ratio_min"] == pytest.approx(math.exp(0.05), abs=1e-4)
    assert stats["on"]["is_ratio_max"] == pytest.approx(math.exp(0.05), abs=1e-4)
    assert stats["capped"]["is_ratio_max"] == pytest.approx(1.02, abs=1e-6)
    assert stats["on"]["loss"] == pytest.approx(stats["off"]["loss"] * math.exp(0.05), rel=1e-4, abs=1e-7)
    assert stats["on"]["entropy"] > 0 and 0.0 <= stats["on"]["clip_ratio_region"] <= 1.0
