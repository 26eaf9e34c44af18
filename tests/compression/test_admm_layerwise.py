"""ADMM on each linear's output reconstruction (``admm_objective="reconstruction"``):
the Gram matrices against their formula, the W-step against its optimality condition,
the refit against a direct least-squares solve on the support, the whole solver against
brute force over every 2:4 support on small rows and against Wanda and magnitude on
correlated inputs, and the pipeline and CLI on a tiny Llama and a hand-made model."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

from zeal.compression.admm_layerwise import _Quadratic, collect_grams, reconstruction_admm, target_groups
from zeal.compression.modules import linear_targets
from zeal.compression.nm import group_density, nm_mask
from zeal.compression.pipeline import CompressJob, compress_model
from zeal.models.llama import Llama, LlamaConfig


def _correlated(tokens: int, dim: int, seed: int) -> torch.Tensor:
    """Inputs whose features co-vary strongly (a low-rank part) and differ in scale."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(tokens, 3, generator=g) @ torch.randn(3, dim, generator=g)
    return (base + 0.3 * torch.randn(tokens, dim, generator=g)) * torch.linspace(0.3, 2.0, dim)


def _error(w: torch.Tensor, w0: torch.Tensor, x: torch.Tensor) -> float:
    return float((x @ (w - w0).T).pow(2).sum())


def test_collect_grams_is_xtx_over_tokens_and_names_an_unreached_linear():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 8))
    x = torch.randn(3, 5, 8)
    grams = collect_grams(linear_targets(net), lambda: net(x))
    flat = x.reshape(-1, 8)
    assert torch.allclose(grams["0"], flat.T @ flat / 15, atol=1e-5)
    h = torch.relu(net[0](flat)).detach()
    assert torch.allclose(grams["2"], h.T @ h / 15, atol=1e-5)
    targets = {**linear_targets(net), "spare": nn.Linear(8, 8)}  # never called by the forward
    with pytest.raises(ValueError, match="spare"):
        collect_grams(targets, lambda: net(x))


def test_w_step_solves_its_quadratic_and_refit_is_least_squares_on_the_support():
    g = torch.Generator().manual_seed(1)
    x = _correlated(64, 12, 1)
    w0 = torch.randn(5, 12, generator=g)
    q = _Quadratic(w0, x.T @ x / 64, damp=0.01)
    z, u, rho = torch.randn(5, 12, generator=g), torch.randn(5, 12, generator=g), 0.7
    w = q.solve(z - u, rho)
    # gradient of 1/2 (w - w0) H (w - w0)^T + rho/2 |w - z + u|^2 is zero
    assert torch.allclose((w - w0) @ q.h + rho * (w - z + u), torch.zeros_like(w), atol=1e-4)
    mask = nm_mask(torch.rand(5, 12, generator=g), 2, 4)
    fitted = q.refit(torch.zeros(5, 12), mask, iters=12)
    for r in range(5):
        keep = mask[r].nonzero().squeeze(1)
        h = q.h.double()
        exact = torch.linalg.solve(h[keep][:, keep], (w0[r].double() @ h)[keep])
        assert torch.allclose(fitted[r, keep].double(), exact, atol=1e-4)
        assert bool((fitted[r][~mask[r]] == 0).all())


def test_reconstruction_admm_finds_the_best_support_of_small_rows():
    """Every row of 8 inputs has 36 two-of-four supports: ADMM + refit must come within 2 %
    of the best one's output error (the problem is non-convex: exact is not promised), and
    do better than Wanda's support refitted."""
    x = _correlated(200, 8, 2)
    lin = nn.Linear(8, 6, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(6, 8, generator=torch.Generator().manual_seed(3)))
    w0 = lin.weight.detach().clone()
    gram = x.T @ x / 200
    q = _Quadratic(w0, gram, damp=0.01)
    masks, hist = reconstruction_admm({"lin": lin}, lambda: lin(x), 2, 4, iters=80, log=lambda _: None)
    assert hist[-1].primal_rel < 1e-4 < hist[0].primal_rel
    supports = [torch.tensor([i in a or i in b for i in range(8)])
                for a in itertools.combinations(range(4), 2) for b in itertools.combinations(range(4, 8), 2)]
    wanda = nm_mask(w0.abs() * gram.diagonal().sqrt(), 2, 4)

    def refitted(r: int, support: torch.Tensor) -> float:
        return q.value(q.refit(w0[r:r + 1], support.unsqueeze(0), 12), w0[r:r + 1])

    for r in range(6):
        best = min(refitted(r, s) for s in supports)
        got = q.value(lin.weight.detach()[r:r + 1], w0[r:r + 1])
        assert got <= best * 1.02 + 1e-9
        assert got <= refitted(r, wanda[r]) + 1e-9
    assert torch.equal(masks["lin.weight"], lin.weight.detach() != 0)


def test_reconstruction_admm_beats_wanda_and_magnitude_on_correlated_inputs():
    x = _correlated(512, 64, 4)
    lin = nn.Linear(64, 32, bias=False)
    w0 = lin.weight.detach().clone()
    masks, _ = reconstruction_admm({"l": lin}, lambda: lin(x), 2, 4, log=lambda _: None)
    w = lin.weight.detach()
    assert bool((group_density(w != 0, 4) <= 2).all())
    assert bool((group_density(masks["l.weight"], 4) == 2).all())
    admm = _error(w, w0, x)
    wanda = _error(w0 * nm_mask(w0.abs() * x.pow(2).sum(0).sqrt(), 2, 4), w0, x)
    magnitude = _error(w0 * nm_mask(w0.abs(), 2, 4), w0, x)
    assert admm < 0.5 * wanda < 0.5 * magnitude


class _Awkward(nn.Module):
    """Linears in a ModuleDict, one of them applied twice, a bias, a non-linear branch."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.blocks = nn.ModuleDict({"a": nn.Linear(16, 16), "b": nn.Linear(16, 16, bias=False)})
        self.head = nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        h = self.emb(ids)
        h = h + torch.tanh(self.blocks["a"](h))
        h = h + self.blocks["b"](torch.relu(self.blocks["a"](h)))
        logits = self.head(h)
        if labels is None:
            return logits
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 32), labels[:, 1:].reshape(-1))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("make", ["llama", "awkward"])
def test_pipeline_reconstruction_admm_then_masked_finetune(make):
    torch.manual_seed(0)
    if make == "llama":
        model = Llama(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                  initializer_range=0.08))
        vocab, exclude = 64, ("lm_head",)
    else:
        model, vocab, exclude = _Awkward(), 32, ("head",)
    data = torch.randint(0, vocab, (10, 16), generator=torch.Generator().manual_seed(2))
    job = CompressJob(2, 4, "admm", steps=6, lr=1e-3, loss="ce", exclude=exclude)
    report = compress_model(model, data[:4], data[8:], job, log=lambda _: None, train=data[4:8])
    assert report.admm_residuals and report.admm_residuals[-1].primal_rel < 1e-3
    assert report.targets
    for name in report.targets:
        w = model.get_submodule(name).weight
        assert bool((group_density(w != 0, 4) <= 2).all()), name
    assert torch.isfinite(torch.tensor(report.ppl_after))


def test_reconstruction_admm_flags_are_checked():
    lin = nn.Linear(8, 4)
    with pytest.raises(ValueError, match="rho"):
        reconstruction_admm({"l": lin}, lambda: lin(torch.eye(8)), 2, 4, rho=2.0, rho_max=1.0)
    with pytest.raises(ValueError, match="admm_objective"):
        compress_model(lin, torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long),
                       CompressJob(2, 4, "admm", admm_objective="nope"), log=lambda _: None)


def test_target_groups_are_blocks_in_model_order():
    model = Llama(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    groups = target_groups(linear_targets(model))
    assert [sorted({k.rsplit(".", 2)[0] for k in g}) for g in groups] == [["model.layers.0"], ["model.layers.1"]]
    assert [len(g) for g in groups] == [7, 7]  # q, k, v, o, gate, up, down
    assert [list(g) for g in target_groups(linear_targets(_Awkward(), exclude=("head",)))] == [["blocks.a"], ["blocks.b"]]


def test_sequential_calibrates_each_block_on_the_pruned_blocks_before_it():
    """Block 1 of a two-block chain is pruned on the outputs of block 0 already pruned:
    the same as pruning block 0 alone, then block 1 alone on the model as it then is."""
    torch.manual_seed(5)
    chain = nn.ModuleDict({"layers": nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 8)])})
    x = _correlated(128, 16, 6)

    def forward(net: nn.ModuleDict) -> torch.Tensor:
        return net["layers"][1](torch.tanh(net["layers"][0](x)))

    seq, by_hand, at_once = copy.deepcopy(chain), copy.deepcopy(chain), copy.deepcopy(chain)
    calls = []
    reconstruction_admm(linear_targets(seq), lambda: calls.append(forward(seq)), 2, 4, log=lambda _: None)
    assert len(calls) == 2  # once per block
    t = linear_targets(by_hand)
    for k in t:
        reconstruction_admm({k: t[k]}, lambda: forward(by_hand), 2, 4, sequential=False, log=lambda _: None)
    reconstruction_admm(linear_targets(at_once), lambda: forward(at_once), 2, 4, sequential=False,
                        log=lambda _: None)
    for i in range(2):
        assert torch.equal(seq["layers"][i].weight, by_hand["layers"][i].weight)
    assert torch.equal(seq["layers"][0].weight, at_once["layers"][0].weight)
    assert not torch.equal(seq["layers"][1].weight, at_once["layers"][1].weight)  # dense vs pruned inputs


@pytest.mark.timeout(60)
def test_layer_replay_gives_the_masks_of_a_forward_per_block():
    """With ``model`` given, the sequential pass runs the model once and then each layer on
    the recorded inputs: the same masks and weights as a whole forward per block (the old
    cost: one calibration forward per block), with the forward run once."""
    torch.manual_seed(3)
    model = Llama(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                              initializer_range=0.08))
    data = torch.randint(0, 64, (6, 16), generator=torch.Generator().manual_seed(4))
    replay, full = copy.deepcopy(model), copy.deepcopy(model)
    calls, lines = [], []

    def feed(net):
        return lambda: calls.append([net(data[i:i + 2]) for i in range(0, 6, 2)])

    m1, _ = reconstruction_admm(linear_targets(replay, exclude=("lm_head",)), feed(replay), 2, 4, iters=20,
                                model=replay, log=lines.append)
    assert len(calls) == 1
    m2, _ = reconstruction_admm(linear_targets(full, exclude=("lm_head",)), feed(full), 2, 4, iters=20,
                                log=lambda _: None)
    assert len(calls) == 1 + 3
    assert m1.keys() == m2.keys() and all(torch.equal(m1[k], m2[k]) for k in m1)
    for (k, a), b in zip(replay.named_parameters(), full.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=k)
    progress = [s for s in lines if s.startswith("admm block")]
    assert len(progress) == 3 and "3/3" in progress[-1] and "left" in progress[0]
