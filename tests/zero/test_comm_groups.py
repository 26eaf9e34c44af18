"""ZeRO's CommGroups (zeal/zero/groups.py): parameters laid out over a Comm of their own,
given by the caller. ZeRO itself names no feature that uses them (experts, MoE)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from zeal.config.schema import ZeroConfig
from zeal.dist.context import init_distributed
from zeal.dist.mesh import build_mesh
from zeal.zero.apply import apply_zero
from zeal.zero.groups import CommGroup, RoutedReducer, comm_of, group_index, split_groups
from zeal.zero.units import default_init_fn

ZERO = Path(__file__).resolve().parents[2] / "zeal" / "zero"


def test_zero_names_neither_experts_nor_moe():
    found = [f"{p.relative_to(ZERO.parent)}:{i}" for p in sorted(ZERO.rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"expert|moe", line, re.I)]
    assert not found, found


def test_group_lookup_and_split():
    a, b, c = (nn.Parameter(torch.zeros(1)) for _ in range(3))
    mesh = build_mesh(init_distributed())
    g = CommGroup(frozenset({id(b)}), mesh.world, mean_over=1, buffers=frozenset({id(c)}))
    assert [group_index([g], p) for p in (a, b, c)] == [0, 1, 0]
    assert split_groups([[a, b], [c]], [g]) == [[[a], [c]], [[b], []]]
    assert comm_of([g], mesh.dp, b) is mesh.world and comm_of([g], mesh.dp, a) is mesh.dp
    assert comm_of([g], mesh.dp, c, buffer=True) is mesh.world


@pytest.mark.parametrize("stage", [0, 3])
def test_a_groups_parameters_get_units_over_its_comm(stage):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    mesh = build_mesh(init_distributed())
    own = frozenset(id(p) for p in model[1].parameters())
    group = CommGroup(own, mesh.world, mean_over=1, spread=mesh.ep, name="g")
    params = list(model.parameters())
    zero = apply_zero(model, ZeroConfig(stage=stage), mesh, torch.float32, [params], {}, default_init_fn(model), 0,
                      comm_groups=[group])
    by_group = {u.comm_group: u for u in zero.units}
    assert set(by_group) == {0, 1}
    assert by_group[1].comm is mesh.world and by_group[0].comm is None
    assert {id(p) for p in by_group[1].params} == own
    assert isinstance(zero.reducer, RoutedReducer) and zero.reducer.spread == [(1, mesh.ep)]
    assert zero.comm_groups == [group]
