"""Gating against hand-worked examples (DeepSpeed's rules), and the two dispatch paths."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zeal.moe import MoE, capacity, top1gating, top2gating


def _logits(probs: list[list[float]]) -> torch.Tensor:
    return torch.tensor(probs).log()  # softmax(log p) = p


def test_capacity_formula():
    assert capacity(8, 4, 1.0, 1) == 2          # ceil(8/4 · 1.0)
    assert capacity(8, 4, 1.5, 1) == 3          # ceil(3.0)
    assert capacity(10, 4, 1.0, 1) == 3         # ceil(2.5)
    assert capacity(8, 4, 1.0, 1, k=2) == 4     # top-2 doubles the factor
    assert capacity(8, 4, 1.0, 5) == 5          # min_capacity wins


def test_top1_drops_beyond_capacity_in_token_order():
    # 6 tokens, 3 experts; first choices 0,0,0,1,0,2; capacity ceil(6/3 · 1) = 2
    p = [[0.6, 0.2, 0.2], [0.5, 0.3, 0.2], [0.7, 0.1, 0.2], [0.2, 0.5, 0.3], [0.4, 0.3, 0.3], [0.1, 0.2, 0.7]]
    r = top1gating(_logits(p), 1.0, 1, use_rts=False)
    assert r.capacity == 2
    assert r.experts[0].tolist() == [0, 0, 0, 1, 0, 2]
    assert r.kept[0].tolist() == [True, True, False, True, False, True]
    assert r.slots[0].tolist() == [0, 1, 0, 0, 0, 0]
    assert r.exp_counts.tolist() == [4, 1, 1]  # counted before dropping
    torch.testing.assert_close(r.gates[0], torch.tensor([0.6, 0.5, 0.0, 0.5, 0.0, 0.7]))


def test_top1_min_capacity_and_no_drop():
    p = [[0.6, 0.2, 0.2]] * 5 + [[0.1, 0.2, 0.7]]
    r = top1gating(_logits(p), 1.0, 4, use_rts=False)
    assert r.capacity == 4 and r.kept[0].tolist() == [True] * 4 + [False, True]
    r = top1gating(_logits(p), 1.0, 1, drop_tokens=False)
    assert r.capacity == 5 and bool(r.kept.all())  # the largest expert count
    assert r.slots[0].tolist() == [0, 1, 2, 3, 4, 0]


def test_top1_random_token_selection_keeps_capacity_of_the_routed():
    torch.manual_seed(0)
    p = [[0.6, 0.2, 0.2]] * 6 + [[0.2, 0.6, 0.2]] * 2
    seen = set()
    for _ in range(20):
        r = top1gating(_logits(p), 1.0, 1, use_rts=True)  # capacity ceil(8/3) = 3
        kept = r.kept[0].tolist()
        assert sum(kept[:6]) == 3 and kept[6:] == [True, True]
        assert sorted(r.slots[0][:6][r.kept[0][:6]].tolist()) == [0, 1, 2]
        seen.add(tuple(kept[:6]))
    assert len(seen) > 1  # random, not the first three


def test_aux_loss_hand_value():
    # first choices 0,0,1,0: ce = (0.75, 0.25); me = (0.65, 0.35); l_aux = 2 · (0.4875 + 0.0875)
    p = [[0.8, 0.2], [0.6, 0.4], [0.3, 0.7], [0.9, 0.1]]
    assert float(top1gating(_logits(p), 1.0, 1).l_aux) == pytest.approx(1.15, rel=1e-6)


def test_top2_second_expert_rules():
    p = [[0.6, 0.3, 0.1], [0.5, 0.1, 0.4], [0.2, 0.7, 0.1], [0.1, 0.3, 0.6]]
    r = top2gating(_logits(p), 0.5, 1, second_expert_sampling=False)
    assert r.capacity == 2  # ceil(4/3 · 0.5 · 2)
    assert r.experts.tolist() == [[0, 0, 1, 2], [1, 2, 0, 1]]
    # second choices queue after every first choice of their expert: e1 had 1, e2 1, e0 2
    assert r.slots[0].tolist() == [0, 1, 0, 0]
    assert r.kept.tolist() == [[True] * 4, [True, True, False, False]]
    assert r.slots[1][:2].tolist() == [1, 1]
    torch.testing.assert_close(r.gates, torch.tensor([[0.6 / 0.9, 0.5 / 0.9, 1.0, 1.0],
                                                      [0.3 / 0.9, 0.4 / 0.9, 0.0, 0.0]]))
    assert r.exp_counts.tolist() == [3, 3, 2]
    # me = (0.35, 0.35, 0.3), ce = (0.5, 0.25, 0.25): mean(me·ce) · 3 · 3
    assert float(r.l_aux) == pytest.approx(0.3375 * 3, rel=1e-6)


def _moe(k: int, dispatch: str, **kw) -> MoE:
    torch.manual_seed(3)
    expert = nn.Sequential(nn.Linear(6, 10), nn.GELU(), nn.Linear(10, 6))
    return MoE(6, expert, 4, k=k, min_capacity=1, use_rts=False, top2_2nd_expert_sampling=False,
               dispatch=dispatch, **kw)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("drop", [True, False])
def test_sort_dispatch_equals_einsum(k, drop):
    torch.manual_seed(4)
    x = torch.randn(3, 7, 6)
    outs = []
    for dispatch in ("einsum", "sort"):
        moe = _moe(k, dispatch, drop_tokens=drop, capacity_factor=0.6)
        xi = x.clone().requires_grad_(True)
        out, l_aux, counts = moe(xi)
        (out.square().sum() + l_aux).backward()
        outs.append((out, xi.grad, [p.grad for p in moe.parameters()], counts))
    (o1, g1, p1, c1), (o2, g2, p2, c2) = outs
    torch.testing.assert_close(o1, o2, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(g1, g2, rtol=1e-6, atol=1e-7)
    for a, b in zip(p1, p2):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # summation order
    assert torch.equal(c1, c2)


def test_moe_output_is_gate_weighted_expert_output_and_residual_mix():
    moe = _moe(1, "einsum", drop_tokens=False, use_residual=True)
    x = torch.randn(5, 6)
    out, _, counts = moe(x)
    probs = torch.softmax(x @ moe.deepspeed_moe.gate.wg.weight.T, dim=1)
    top = probs.argmax(dim=1)
    experts = list(moe.deepspeed_moe.experts.deepspeed_experts.values())
    routed = torch.stack([probs[s, top[s]] * experts[top[s]](x[s]) for s in range(5)])
    coef = torch.softmax(moe.coefficient(x), dim=-1)
    torch.testing.assert_close(out, routed * coef[:, :1] + moe.mlp(x) * coef[:, 1:], rtol=1e-5, atol=1e-6)
    assert counts.tolist() == torch.bincount(top, minlength=4).tolist()


def test_noisy_policies_act_in_training_only():
    x = torch.randn(16, 6)
    plain = _moe(1, "einsum")
    for policy in ("Jitter", "RSample"):
        moe = _moe(1, "einsum", noisy_gate_policy=policy)
        moe.eval(), plain.eval()
        torch.testing.assert_close(moe(x)[0], plain(x)[0])
        moe.train()
        torch.manual_seed(0)
        outs = {tuple(moe(x)[2].tolist()) for _ in range(10)}
        assert all(sum(c) == 16 for c in outs)
    with pytest.raises(ValueError, match="noisy_gate_policy"):
        _moe(1, "einsum", noisy_gate_policy="Gauss")


def test_experts_named_by_global_index():
    full = _moe(2, "sort")
    keys = [k for k in full.state_dict() if "experts" in k]
    assert {k.split(".")[3] for k in keys} == {"0", "1", "2", "3"}
    assert all(getattr(p, "allreduce", True) is False for p in full.deepspeed_moe.experts.parameters())
    torch.manual_seed(9)
    part = MoE(6, nn.Sequential(nn.Linear(6, 10), nn.GELU(), nn.Linear(10, 6)), 4, ep_size=2, k=2)
    part.deepspeed_moe.experts.keep_rank(1)  # what binding to ep rank 1 does
    assert {k.split(".")[3] for k in part.state_dict() if "experts" in k} == {"2", "3"}
    res = part.load_state_dict(full.state_dict(), strict=False)  # a single-process state dict
    assert not res.missing_keys and {k.split(".")[3] for k in res.unexpected_keys} == {"0", "1"}
    for name, t in part.state_dict().items():
        assert torch.equal(t, full.state_dict()[name]), name


def test_deepspeed_import_path_and_param_groups():
    import zeal.deepspeed as deepspeed

    moe = deepspeed.moe.layer.MoE(6, nn.Linear(6, 6), 2)
    groups = deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer(
        {"params": list(moe.parameters()), "lr": 0.1})
    assert [len(g["params"]) for g in groups] == [1, 4]  # router | 2 experts x (weight, bias)
    assert groups[1]["moe"] and groups[1]["lr"] == 0.1
    assert all(deepspeed.moe.utils.is_moe_param(p) for p in groups[1]["params"])


def _unbound_forward(rank: int, world: int) -> str:
    import torch.distributed as dist

    from zeal.dist.context import init_distributed

    init_distributed()
    moe = MoE(hidden_size=8, expert=nn.Linear(8, 8), num_experts=2, ep_size=2, k=1)  # after init: sliced
    groups = dist.distributed_c10d._world.group_count
    try:
        moe(torch.randn(3, 8))
    except RuntimeError as e:
        assert dist.distributed_c10d._world.group_count == groups  # no process group was built
        return str(e)
    return "ran"


@pytest.mark.timeout(120)
def test_an_unbound_expert_parallel_layer_builds_no_group_and_says_how_to_bind():
    from tests.dist_harness import run_ranks

    for msg in run_ranks(_unbound_forward, 2):
        assert "not bound" in msg and "apply_moe" in msg, msg
