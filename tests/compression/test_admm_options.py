"""ADMM's options: the proximal penalty step (against its optimality condition, and reaching
the N:M set under Adam where the penalty gradient does not), the activation metric (its
projection is the nearest point in the weighted norm, by brute force), distillation loss
(against the KL formula), the three-way text split, and the pipeline's ADMM on a tiny Llama
reaching the 2:4 set before its hard prune."""

from __future__ import annotations

import itertools

import pytest
import torch

from zeal.compression.admm import ADMM, RhoSchedule
from zeal.compression.calibration import split_text, split_three
from zeal.compression.nm import group_density, nm_mask, nm_project
from zeal.compression.pipeline import CompressJob, compress_model, distill_loss
from zeal.models.llama import Llama, LlamaConfig


def test_prox_step_solves_its_quadratic_and_spares_the_rest():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 8, generator=g)
    region = (torch.arange(8) < 6).float().expand(3, 8)  # the last two columns are not sparsified
    d = torch.rand(1, 8, generator=g) + 0.1
    admm = ADMM({"w": w}, lambda _k, v: nm_project(v, 2, 4), RhoSchedule(0.7), region={"w": region}, metric={"w": d})
    admm.U["w"] = torch.randn(3, 8, generator=g) * region
    w0, step = w.clone(), 0.3
    admm.prox_(step)
    z, u = admm.Z["w"], admm.U["w"]
    # optimality of argmin_V rho/2*D*(V - Z + U)^2 + (V - W0)^2/(2*step), elementwise, in the region
    grad = 0.7 * d * (w - z + u) + (w - w0) / step
    assert torch.allclose(grad * region, torch.zeros_like(w), atol=1e-5)
    assert torch.equal(w[:, 6:], w0[:, 6:])


def _toy(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 16, generator=g) * torch.linspace(0.2, 3.0, 16)  # features of very different scale
    w_true = nm_project(torch.randn(4, 16, generator=g), 2, 4)
    return x, x @ w_true.T, w_true


def _run_adam(x, y, penalty: str, metric: bool, iters=60, inner=10, lr=3e-2):
    w = torch.zeros(4, 16, requires_grad=True)
    norms = x.pow(2).sum(0).sqrt()
    d = {"w": (norms.pow(2) / norms.pow(2).mean()).unsqueeze(0)} if metric else None
    score = norms.unsqueeze(0) if metric else torch.ones(1, 16)
    admm = ADMM({"w": w}, lambda _k, v: v * nm_mask(v.abs() * score, 2, 4), RhoSchedule(0.01, 1.1, 2.0), metric=d)
    opt = torch.optim.Adam([w], lr=lr)
    hist = []
    for _ in range(iters):
        for _ in range(inner):
            opt.zero_grad()
            (x @ w.T - y).pow(2).mean().backward()
            if penalty == "grad":
                admm.add_penalty_grad_()
            opt.step()
            if penalty == "prox":
                admm.prox_()
        hist.append(admm.update())
    return w.detach(), hist


@pytest.mark.parametrize("metric", [False, True])
def test_prox_admm_under_adam_reaches_the_known_sparse_optimum(metric):
    x, y, w_true = _toy(0)
    w, hist = _run_adam(x, y, "prox", metric)
    assert hist[-1].primal_rel < 1e-3 and hist[0].primal_rel > 0.1
    assert torch.equal(nm_mask(w.abs(), 2, 4), w_true != 0)
    assert torch.allclose(w, w_true, atol=5e-3)


def test_adam_normalises_the_penalty_gradient_but_not_the_prox_step():
    """One weight at 1 pulled towards Z = 0 with rho = 1 and no task loss: through the
    gradient Adam moves it by ~lr per step; the proximal step halves it per step."""
    w_grad, w_prox = torch.ones(1, 4, requires_grad=True), torch.ones(1, 4, requires_grad=True)
    nothing = lambda _k, v: torch.zeros_like(v)  # noqa: E731  (the all-zero "projection")
    a_grad, a_prox = ADMM({"w": w_grad}, nothing, RhoSchedule(1.0)), ADMM({"w": w_prox}, nothing, RhoSchedule(1.0))
    opt_grad, opt_prox = torch.optim.Adam([w_grad], lr=1e-3), torch.optim.Adam([w_prox], lr=1e-3)
    for _ in range(20):
        opt_grad.zero_grad()
        a_grad.add_penalty_grad_()
        opt_grad.step()
        opt_prox.zero_grad()
        w_prox.sum().mul(0).backward()
        opt_prox.step()
        a_prox.prox_()
    assert torch.allclose(w_grad.detach(), torch.full((1, 4), 1 - 20e-3), atol=1e-4)
    assert torch.allclose(w_prox.detach(), torch.full((1, 4), 0.5 ** 20), atol=1e-9)


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (3, 6)])
def test_activation_metric_projection_is_the_nearest_point_in_the_weighted_norm(n, m):
    g = torch.Generator().manual_seed(n * m)
    w, d = torch.randn(5, m, generator=g), torch.rand(m, generator=g) * 4 + 0.01
    proj = w * nm_mask(w.abs() * d.sqrt(), n, m)  # score |w|*||X_j|| with D_j = ||X_j||^2
    for row in range(5):
        best = min(((w[row] - w[row] * torch.isin(torch.arange(m), torch.tensor(keep))).pow(2) * d).sum().item()
                   for keep in itertools.combinations(range(m), n))
        assert ((w[row] - proj[row]).pow(2) * d).sum().item() == pytest.approx(best, rel=1e-6)


def test_distill_loss_is_the_kl_formula():
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(2, 3, 7, generator=g), torch.randn(2, 3, 7, generator=g)
    p = t.softmax(-1)
    expected = (p * (p.log() - s.log_softmax(-1))).sum(-1).mean()
    assert distill_loss(s, t).item() == pytest.approx(expected.item(), rel=1e-5)
    assert distill_loss(t, t).item() == pytest.approx(0.0, abs=1e-6)


def test_split_three_is_disjoint_and_refines_split_text(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("\n\n".join(f"piece {i}" for i in range(13)))
    calib, train, evals = split_three(f)
    assert calib.split("\n\n") == ["piece 3", "piece 8"]
    assert evals.split("\n\n") == ["piece 4", "piece 9"]
    assert set(train.split("\n\n")) == {f"piece {i}" for i in (0, 1, 2, 5, 6, 7, 10, 11, 12)}
    old_calib, old_evals = split_text(f)
    assert old_evals == evals and set(old_calib.split("\n\n")) == set(calib.split("\n\n")) | set(train.split("\n\n"))
    assert split_three(f) == (calib, train, evals)
    c, t, e = split_three(None)  # pydoc topics, shipped with CPython
    assert c and t and e and len(t) > len(c)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("metric", ["euclidean", "activation"])
def test_pipeline_admm_reaches_two_four_before_the_hard_prune(metric):
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                              initializer_range=0.08))
    data = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(2))
    job = CompressJob(2, 4, "admm", steps=24, lr=1e-3, loss="kd", admm_interval=1, admm_fraction=0.75,
                      admm_objective="loss", admm_metric=metric, rho=0.02, rho_max=2.0)
    report = compress_model(model, data[:2], data[6:], job, log=lambda _: None, train=data[2:6])
    rel = [r.primal_rel for r in report.admm_residuals]
    assert len(rel) == 18 and rel[-1] < 2e-2 and rel[-1] < rel[0] / 5
    assert report.admm_residuals[-1].rho == pytest.approx(2.0)
    for name in report.targets:
        w = model.get_submodule(name).weight
        assert bool((group_density(w != 0, 4) <= 2).all())
