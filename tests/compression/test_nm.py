"""N:M projection: feasibility, nearest point (brute force), idempotence, ties, density."""

import itertools

import pytest
import torch

from zeal.compression.nm import group_density, nm_mask, nm_project, parse_pattern


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (4, 8), (3, 5)])
def test_projection_is_n_of_m_exact_density_and_idempotent(n, m):
    torch.manual_seed(0)
    w = torch.randn(6, 4 * m)
    p = nm_project(w, n, m)
    assert bool((group_density(p != 0, m) == n).all())  # exactly n kept (randn has no zeros)
    assert torch.equal(nm_project(p, n, m), p)
    kept = p != 0
    assert torch.equal(p[kept], w[kept])
    assert int((p != 0).sum()) * m == n * p.numel()


@pytest.mark.parametrize("n,m", [(2, 4), (1, 3), (2, 5)])
def test_projection_is_the_nearest_feasible_point(n, m):
    torch.manual_seed(1)
    for _ in range(20):
        g = torch.randn(m)
        best = min(float(g[[i for i in range(m) if i not in keep]].pow(2).sum())
                   for keep in itertools.combinations(range(m), n))
        assert float((nm_project(g.view(1, m), n, m).view(-1) - g).pow(2).sum()) == pytest.approx(best, abs=1e-7)


def test_ties_keep_the_lower_index_and_dim0_groups():
    w = torch.tensor([[1.0, -1.0, 1.0, 0.5]])
    assert nm_mask(w.abs(), 2, 4).tolist() == [[True, True, False, False]]
    x = torch.randn(8, 3)
    assert torch.equal(nm_project(x, 2, 4, dim=0), nm_project(x.t(), 2, 4).t())


def test_bad_patterns_and_shapes_are_clear_errors():
    assert parse_pattern("2:4") == (2, 4)
    for bad in ("2x4", "5:4", "0:4", "a:b"):
        with pytest.raises(ValueError, match="N:M|N <= M"):
            parse_pattern(bad)
    with pytest.raises(ValueError, match="not a multiple of M=4"):
        nm_project(torch.randn(2, 6), 2, 4)
