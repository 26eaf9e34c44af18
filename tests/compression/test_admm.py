"""ADMM on least squares: converges to a known sparse optimum; beats magnitude-then-finetune."""

import torch

from zeal.compression.admm import ADMM, RhoSchedule
from zeal.compression.nm import nm_mask, nm_project


def _problem(seed: int, sparse_truth: bool):
    g = torch.Generator().manual_seed(seed)
    n_samples, d, out = 256, 16, 4
    mix = torch.eye(d) + 0.8 * torch.randn(d, d, generator=g) / d ** 0.5  # correlated features
    x = torch.randn(n_samples, d, generator=g) @ mix
    w_true = torch.randn(out, d, generator=g)
    if sparse_truth:
        w_true = nm_project(w_true, 2, 4)
    return x, x @ w_true.T, w_true


def _loss(w, x, y):
    return (x @ w.T - y).pow(2).mean()


def _masked_lstsq(x, y, mask):
    """The exact fine-tune under a fixed mask: least squares on the kept inputs of each output."""
    w = torch.zeros(mask.shape)
    for o in range(mask.shape[0]):
        idx = mask[o].nonzero().view(-1)
        w[o, idx] = torch.linalg.lstsq(x[:, idx], y[:, o:o + 1]).solution.view(-1)
    return w


def _admm(x, y, w0, *, via_grad: bool, iters=40, inner=20):
    w = w0.clone().requires_grad_(True)
    admm = ADMM({"w": w}, lambda _k, v: nm_project(v, 2, 4), RhoSchedule(0.05, 1.1, 5.0))
    opt = torch.optim.SGD([w], lr=0.1)
    history = []
    for _ in range(iters):
        for _ in range(inner):
            opt.zero_grad()
            if via_grad:  # what the engine does on the master shards
                _loss(w, x, y).backward()
                admm.add_penalty_grad_()
            else:
                (_loss(w, x, y) + admm.penalty()).backward()
            opt.step()
        history.append(admm.update())
    return w.detach(), history


def test_admm_converges_to_the_known_sparse_optimum():
    x, y, w_true = _problem(0, sparse_truth=True)
    w0 = torch.randn(w_true.shape, generator=torch.Generator().manual_seed(9))
    w, hist = _admm(x, y, w0, via_grad=True)
    assert hist[-1].primal < 1e-4 * hist[0].primal and hist[-1].dual < 1e-3 * max(h.dual for h in hist)
    assert torch.allclose(nm_project(w, 2, 4), w_true, atol=1e-3)
    assert torch.equal(nm_mask(w.abs(), 2, 4), w_true != 0)
    assert hist[-1].rho == 0.05 * 1.1 ** 40  # the schedule grew rho at every Z-step


def test_penalty_in_loss_equals_penalty_gradient():
    x, y, w_true = _problem(1, sparse_truth=False)
    w0 = torch.linalg.lstsq(x, y).solution.T
    a, _ = _admm(x, y, w0, via_grad=True, iters=3, inner=5)
    b, _ = _admm(x, y, w0, via_grad=False, iters=3, inner=5)
    assert torch.allclose(a, b, atol=1e-6)


def test_admm_beats_magnitude_then_finetune():
    wins = []
    for seed in range(3):
        x, y, _ = _problem(seed, sparse_truth=False)
        dense = torch.linalg.lstsq(x, y).solution.T
        w, _ = _admm(x, y, dense, via_grad=True)
        admm_loss = float(_loss(_masked_lstsq(x, y, nm_mask(w.abs(), 2, 4)), x, y))
        magnitude_loss = float(_loss(_masked_lstsq(x, y, nm_mask(dense.abs(), 2, 4)), x, y))
        wins.append(admm_loss < magnitude_loss)
        assert admm_loss <= magnitude_loss * 1.0001, (seed, admm_loss, magnitude_loss)
    assert all(wins)  # strictly better on every seed, not only tied
