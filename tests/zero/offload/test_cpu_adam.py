"""CPUAdam is bit-identical to torch.optim.Adam/AdamW; DPU has staleness exactly one."""

from __future__ import annotations

import json

import pytest
import torch

from zeal.zero.offload import AdamState, CPUAdam, DelayedUpdate

pytestmark = pytest.mark.timeout(60)


def grads_seq(n: int, steps: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for _ in range(steps)]


def torch_reference(p0, grads, cls, **kw) -> torch.Tensor:
    p = torch.nn.Parameter(p0.clone())
    opt = cls([p], **kw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("foreach", [None, False])
def test_bit_identical_to_torch(adamw, wd, foreach):
    n = 100_003  # several vector widths and a ragged tail; big enough for intra-op threads
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(0))
    grads = grads_seq(n, 10)
    kw = dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-7, weight_decay=wd, foreach=foreach, amsgrad=False)
    ref = torch_reference(p0, grads, torch.optim.AdamW if adamw else torch.optim.Adam, **kw)
    opt = CPUAdam(lr=3e-3, betas=(0.8, 0.95), eps=1e-7, weight_decay=wd, adamw=adamw)
    p, state = p0.clone(), AdamState.zeros_like(p0)
    for g in grads:
        g_before = g.clone()
        opt.update(p, g, state)
        assert torch.equal(g, g_before)  # gradients are only read
    assert state.step == 10
    assert torch.equal(p, ref)


def test_fused_matches_torch_fused_and_is_close():
    n = 4099
    p0 = torch.randn(n)
    grads = grads_seq(n, 10)
    ref = torch_reference(p0, grads, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, fused=True)
    exact = torch_reference(p0, grads, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    opt = CPUAdam(lr=1e-2, weight_decay=0.1, fused=True)
    p, state = p0.clone(), AdamState.zeros_like(p0)
    for g in grads:
        opt.update(p, g, state)
    assert torch.equal(p, ref)
    torch.testing.assert_close(p, exact, rtol=1e-5, atol=1e-6)


def test_step_over_groups_and_state_dict_round_trip():
    sizes = [10, 1, 257]
    opt = CPUAdam(lr=1e-2, weight_decay=0.01)
    params = [torch.randn(s) for s in sizes]
    states = [AdamState.zeros_like(p) for p in params]
    for _ in range(3):
        opt.step(params, [torch.randn(s) for s in sizes], states)
    tensors, meta = opt.state_dict(states)
    meta = json.loads(json.dumps(meta))
    assert meta["steps"] == [3, 3, 3] and set(tensors) == {f"{k}.{i}" for k in ("exp_avg", "exp_avg_sq")
                                                           for i in range(3)}
    fresh = CPUAdam()
    loaded = fresh.load_state_dict({k: v.clone() for k, v in tensors.items()}, meta)
    assert fresh.hyperparams() == opt.hyperparams()
    p2 = [p.clone() for p in params]
    g = [torch.randn(s) for s in sizes]
    opt.step(params, g, states)
    fresh.step(p2, g, loaded)
    assert all(torch.equal(a, b) for a, b in zip(params, p2))
    with pytest.raises(ValueError):
        opt.step(params, g[:2], states)
    with pytest.raises(ValueError):
        CPUAdam(betas=(0.9, 1.0))


def quad_grad(p: torch.Tensor, batch: int) -> torch.Tensor:
    """Gradient of 0.5·|p - target_b|², a different target per batch."""
    target = torch.full_like(p, 1.0 + 0.1 * (batch % 3))
    return p - target


def test_delayed_update_has_staleness_one():
    warmup, steps = 3, 60
    p0 = torch.zeros(16)
    # DPU run: master (optimizer-owned) and compute params (what fwd/bwd sees)
    master, compute = p0.clone(), p0.clone()
    opt, state = CPUAdam(lr=0.05), AdamState.zeros_like(p0)
    dpu = DelayedUpdate(warmup)
    seen = []
    for t in range(steps):
        seen.append(compute.clone())
        g = quad_grad(compute, t)  # fresh tensor per step: the double buffer

        def update(g=g):
            opt.update(master, g, state)

        dpu.submit(update, lambda: compute.copy_(master))
    dpu.close()
    # explicit reference: the gradient of step t is taken at p_t while the previous step
    # ran synchronously (t <= warmup: the first delayed update still saw fresh params),
    # at p_{t-1} afterwards
    ref_opt, ref_state = CPUAdam(lr=0.05), AdamState.zeros_like(p0)
    history = [p0.clone()]  # history[k] = parameters after k updates
    for t in range(steps):
        at = history[t] if t <= warmup else history[t - 1]
        assert torch.equal(seen[t], at), t
        p = history[-1].clone()
        ref_opt.update(p, quad_grad(at, t), ref_state)
        history.append(p)
    assert torch.equal(master, history[-1]) and torch.equal(compute, master)
    # converges to the optimum of the averaged quadratic (target mean 1.1)
    assert abs(float(master.mean()) - 1.1) < 0.1


def test_delayed_update_reraises_errors():
    dpu = DelayedUpdate(0)

    def boom():
        raise RuntimeError("cpu step failed")

    dpu.submit(boom, lambda: None)
    with pytest.raises(RuntimeError, match="cpu step failed"):
        dpu.wait()
    dpu.close()
