"""The RLHF formulas against hand-worked examples (numbers computed by hand in the comments)."""

import math

import pytest
import torch

from zeal.rlhf import formulas as fm

pytestmark = pytest.mark.timeout(30)


def t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_rewards_kl_and_score_on_last_valid_token():
    # row 0: prompt action, 3 answer actions, then 1 pad action; row 1: 2 answer actions
    mask = t([0, 1, 1, 1, 0], [0, 0, 1, 1, 0])
    lp = t([-1.0, -1.0, -2.0, -0.5, -9.0], [-1.0, -3.0, -1.0, -1.0, -9.0])
    ref = t([-1.5, -1.5, -1.0, -0.5, -1.0], [-1.0, -1.0, -2.0, -1.0, -1.0])
    r = fm.compute_rewards(lp, ref, torch.tensor([2.0, 7.0]), mask, kl_coef=0.1, clip_reward=5.0)
    # -0.1*(lp-ref) on the answer: row0 = [., -0.05, 0.1, 0]; score 2 on index 3 (not the pad at 4)
    assert torch.allclose(r[0], t(0.0, -0.05, 0.1, 2.0, 0.0))
    # row1: [., ., -0.1, 0] and the score 7 clipped to 5 on index 3
    assert torch.allclose(r[1], t(0.0, 0.0, -0.1, 5.0, 0.0))


def test_gae_and_returns_hand_worked():
    mask = t([0, 1, 1, 0])
    rewards = t([9.0, 0.0, 1.0, 9.0])  # outside the mask: ignored
    values = t([9.0, 0.5, 0.2, 9.0])
    adv, ret = fm.gae(rewards, values, mask, gamma=0.9, lam=0.5)
    # t=2: δ = 1 + 0.9*0 - 0.2 = 0.8, A = 0.8
    # t=1: δ = 0 + 0.9*0.2 - 0.5 = -0.32, A = -0.32 + 0.45*0.8 = 0.04
    assert torch.allclose(adv, t([0.0, 0.04, 0.8, 0.0]), atol=1e-6)
    assert torch.allclose(ret, t([0.0, 0.54, 1.0, 0.0]), atol=1e-6)
    # γ = λ = 1: returns are the reward-to-go
    adv1, ret1 = fm.gae(t([0.0, 2.0, 3.0]), t([1.0, 1.0, 1.0]), t([1, 1, 1]), 1.0, 1.0)
    assert torch.allclose(ret1, t([5.0, 5.0, 3.0]))
    assert torch.allclose(adv1, t([4.0, 4.0, 2.0]))


def test_actor_loss_values_and_gradients_at_and_beyond_clip():
    mask = t([1, 1, 1, 0])
    old = torch.zeros(1, 4)
    adv = t([1.0, 1.0, -1.0, 5.0])
    lp = torch.log(t([1.0, 1.5, 0.5, 3.0])).requires_grad_()
    loss = fm.actor_loss(lp, old, adv, mask, clip=0.2)
    # tok0 ratio 1: -1; tok1 A>0 ratio 1.5: max(-1.5, -1.2) = -1.2 (clipped);
    # tok2 A<0 ratio 0.5: max(0.5, 0.8) = 0.8 (clipped); tok3 masked
    assert loss.item() == pytest.approx((-1.0 - 1.2 + 0.8) / 3, abs=1e-6)
    loss.backward()
    # d/dlp of -A*ratio = -A*ratio/3 where unclipped; zero beyond the clip and under the mask
    assert torch.allclose(lp.grad, t([-1 / 3, 0.0, 0.0, 0.0]), atol=1e-6)
    # ratio below 1-ε with A > 0 is not clipped (the pessimistic term is the unclipped one)
    lp2 = torch.log(t([0.5])).requires_grad_()
    fm.actor_loss(lp2, torch.zeros(1, 1), t([2.0]), t([1])).backward()
    assert lp2.grad.item() == pytest.approx(-2 * 0.5, abs=1e-6)
    # at ratio = 1 it equals the unclipped policy-gradient loss
    z = torch.zeros(2, 3)
    a = torch.randn(2, 3)
    assert fm.actor_loss(z, z, a, torch.ones(2, 3)).item() == pytest.approx(-a.mean().item(), abs=1e-6)


def test_value_loss_and_gradients_at_and_beyond_clip():
    mask = t([1, 1, 1])
    old = t([0.0, 0.0, 0.0])
    ret = t([1.0, 1.0, -1.0])
    v = t([0.1, 0.5, 0.5]).requires_grad_()
    loss = fm.value_loss(v, old, ret, mask, clip=0.2)
    # tok0: (0.1-1)^2 = 0.81 both; tok1: max(0.25, (0.2-1)^2=0.64) = 0.64 (clipped, no grad)
    # tok2: max((0.5+1)^2=2.25, (0.2+1)^2=1.44) = 2.25 (unclipped)
    assert loss.item() == pytest.approx(0.5 * (0.81 + 0.64 + 2.25) / 3, abs=1e-6)
    loss.backward()
    assert torch.allclose(v.grad, t([0.5 * 2 * -0.9 / 3, 0.0, 0.5 * 2 * 1.5 / 3]), atol=1e-6)


def test_whiten_masked():
    x = t([1.0, 3.0, 100.0])
    w = fm.whiten(x, t([1, 1, 0]), eps=0.0)
    # mean 2, population variance 1 over the two masked entries
    assert torch.allclose(w, t([-1.0, 1.0, 0.0]))
    assert torch.allclose(fm.whiten(x, t([1, 1, 0]), shift_mean=False, eps=0.0), t([1.0, 3.0, 0.0]))


def test_ema_after_n_updates():
    theta = [torch.tensor([2.0, -1.0])]
    ema = [torch.tensor([0.0, 0.0])]
    for _ in range(5):
        fm.ema_update(ema, theta, beta=0.9)
    expect = theta[0] + 0.9**5 * (torch.tensor([0.0, 0.0]) - theta[0])
    assert torch.allclose(ema[0], expect, atol=1e-6)
    with pytest.raises(ValueError, match="EMA tensors"):
        fm.ema_update(ema, theta * 2)


def test_reward_model_loss_identical_divergent_and_different_lengths():
    pad = 0
    vc = t([0.0, 0.0, 1.0, 2.0, 3.0])
    vr = t([0.0, 0.0, 0.0, 0.0, 0.0])
    # identical pair: only the last position counts, even where it is padding
    ids = torch.tensor([[5, 6, 7, 0, 0]])
    loss, cs, rs = fm.reward_model_loss(ids, ids, vc, vr, pad)
    assert loss.item() == pytest.approx(-math.log(1 / (1 + math.exp(-3.0))), abs=1e-6)
    assert cs.item() == 1.0 and rs.item() == 0.0  # value at the last non-pad token (index 2)
    # diverging at index 1, chosen ends at 3 (first pad), rejected at 4: span [1, 4)
    c = torch.tensor([[5, 6, 7, 0, 0]])
    r = torch.tensor([[5, 8, 7, 9, 0]])
    loss, cs, rs = fm.reward_model_loss(c, r, vc, vr, pad)
    expect = sum(-math.log(1 / (1 + math.exp(-d))) for d in (0.0, 1.0, 2.0)) / 3
    assert loss.item() == pytest.approx(expect, abs=1e-6)
    assert cs.item() == 1.0 and rs.item() == 0.0
    # one leading pad (OPT's rule): the end is the second pad
    c2 = torch.tensor([[0, 6, 7, 0, 0]])
    r2 = torch.tensor([[0, 6, 9, 0, 0]])
    loss, cs, _ = fm.reward_model_loss(c2, r2, vc, vr, pad, num_padding_at_beginning=1)
    assert loss.item() == pytest.approx(-math.log(1 / (1 + math.exp(-1.0))), abs=1e-6)  # span [2, 3)
    assert cs.item() == 1.0


def test_dpo_loss_hand_worked():
    c, r = t([-5.0, -3.0]), t([-6.0, -2.0])
    rc, rr = t([-5.5, -3.0]), t([-5.5, -3.0])
    loss, cr, rr_ = fm.dpo_loss(c, r, rc, rr, beta=0.5)
    # margins: 0.5*((0.5) - (-0.5)) = 0.5 ; 0.5*((0) - (1)) = -0.5
    expect = (math.log1p(math.exp(-0.5)) + math.log1p(math.exp(0.5))) / 2
    assert loss.item() == pytest.approx(expect, abs=1e-6)
    assert torch.allclose(cr, t([0.25, 0.0])) and torch.allclose(rr_, t([-0.25, 0.5]))
    # policy == reference: log 2
    z = torch.zeros(3)
    assert fm.dpo_loss(z, z, z, z)[0].item() == pytest.approx(math.log(2), abs=1e-7)


def test_group_advantages_and_k3():
    adv = fm.group_advantages(t(1.0, 0.0, 0.0, 1.0, 2.0, 2.0), group_size=2, eps=0.0)
    s = math.sqrt(0.5)  # unbiased std of {0, 1}
    assert torch.allclose(adv, t(0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0.0, 0.0))
    assert torch.allclose(fm.group_advantages(t(1.0, 3.0), 2, scale=False), t(-1.0, 1.0))
    with pytest.raises(ValueError, match="groups of 4"):
        fm.group_advantages(t(1.0, 2.0, 3.0), 4)
    # k3: d = ref - lp; e^d - d - 1
    k = fm.k3_kl(t(0.0, -1.0), t(0.0, 0.0))
    assert torch.allclose(k, t(0.0, math.e - 2.0))
    assert (fm.k3_kl(torch.randn(100), torch.randn(100)) >= 0).all()


def test_grpo_loss_clip_and_aggregation():
    lp = torch.log(t([1.5, 1.0], [0.5, 1.0])).requires_grad_()
    old = torch.zeros(2, 2)
    mask = t([1, 1], [1, 0])
    adv = t(1.0, -1.0)
    loss = fm.grpo_loss(lp, old, None, adv, mask, clip=0.2, beta=0.0, loss_type="sequence")
    # row0: -min(1.5, 1.2) = -1.2, -1 → mean -1.1 ; row1: -min(-0.5, -0.8) = 0.8 → 0.8; mean -0.15
    assert loss.item() == pytest.approx(-0.15, abs=1e-6)
    loss.backward()
    assert torch.allclose(lp.grad, t([0.0, -0.25], [0.0, 0.0]), atol=1e-6)  # clipped tokens: no gradient
    tok = fm.grpo_loss(lp.detach(), old, None, adv, mask, beta=0.0, loss_type="token")
    assert tok.item() == pytest.approx((-1.2 - 1.0 + 0.8) / 3, abs=1e-6)
    # β·k3 is added per token
    ref = t([0.0, 0.0], [0.0, 0.0])
    with_kl = fm.grpo_loss(lp.detach(), old, ref, adv, mask, beta=0.1, loss_type="token")
    k = fm.k3_kl(lp.detach(), ref)
    assert with_kl.item() == pytest.approx(tok.item() + 0.1 * ((k * mask).sum() / 3).item(), abs=1e-6)


def test_token_logprobs():
    logits = torch.randn(2, 4, 7)
    tokens = torch.randint(0, 7, (2, 4))
    lp = fm.token_logprobs(logits, tokens)
    ref = torch.log_softmax(logits, -1)
    assert lp.shape == (2, 3)
    assert lp[1, 2].item() == pytest.approx(ref[1, 2, tokens[1, 3]].item(), abs=1e-6)
