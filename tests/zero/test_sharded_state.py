"""The sharded-state API on 2 gloo ranks: the owned boxes tile every parameter exactly
once (stages 0–3), their values are the model's parameters and the optimizer's
moments; loading through the API sets the model on every rank; a failure on one rank
raises on every rank (no hang)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.checkpoint.test_resume_reshard import config, train
from tests.dist_harness import run_ranks
from tests.train.models import TinyNet

STAGES = [0, 1, 2, 3]


def _owned(engine) -> list:
    """(name, box, master, moments, scalars) of every owned box, as plain data."""
    with engine.sharded_state() as st:
        out = [(sh.name, [list(r) for r in sh.box], sh.master.clone(), {k: v.clone() for k, v in sh.moments.items()},
                {k: float(v) for k, v in sh.scalars.items()}) for sh in st.shards]
        assert list(st.params) == [n for n, _ in engine.module.named_parameters()]
        shapes = {n: list(p.shape) for n, p in st.params.items()}
        trainable = {n: p.trainable for n, p in st.params.items()}
    return [out, shapes, trainable]


def _value(name: str, shape, box) -> torch.Tensor:
    """A value that depends on the parameter and the element: what the load test writes."""
    full = torch.arange(int(np.prod(shape)), dtype=torch.float32).view(shape) * 1e-3 + len(name)
    return full[tuple(slice(a, b) for a, b in box)].clone()


def _run(rank: int, world: int):
    import zeal
    from zeal.zero.sharded_state import ParamShard, ShardedStateError

    out = {}
    for stage in STAGES:
        torch.manual_seed(0)
        engine = zeal.initialize(TinyNet(), config(stage))
        train(engine, rank, world, range(0, 2))
        owned = _owned(engine)
        params = engine.module_state_dict()

        def read(info, box):
            moments = {"exp_avg": torch.full([b - a for a, b in box], 0.5)} if info.trainable else {}
            return ParamShard(info, box, _value(info.name, info.shape, box).to(info.dtype), moments,
                              {"step": torch.tensor(7.0)} if info.trainable else {})

        engine.load_sharded_state(read)
        loaded = engine.module_state_dict()
        after = _owned(engine)

        def failing(info, box):
            if rank == 1 and info.name == "l2.weight":
                raise KeyError("no such piece on rank 1")
            return read(info, box)

        try:
            engine.load_sharded_state(failing)
            failed = None
        except ShardedStateError as e:
            failed = [e.rank, str(e)]
        out[stage] = {"owned": owned, "params": params, "loaded": loaded, "after": after, "failed": failed}
    return out


@pytest.mark.timeout(300)
def test_boxes_tile_parameters_and_load_round_trip():
    res = run_ranks(_run, 2, timeout=240)
    for stage in STAGES:
        shapes, trainable = res[0][stage]["owned"][1], res[0][stage]["owned"][2]
        params = res[0][stage]["params"]
        cover = {n: torch.zeros(s) for n, s in shapes.items()}
        for rank in range(2):
            for name, box, master, moments, scalars in res[rank][stage]["owned"][0]:
                idx = tuple(slice(a, b) for a, b in box)
                cover[name][idx] += 1
                # the master is the parameter's value there (fp32 training: bit-exact)
                assert np.array_equal(master, params[name][idx]), (stage, name, box)
                if trainable[name]:
                    assert set(moments) == {"exp_avg", "exp_avg_sq"} and scalars == {"step": 2.0}, (stage, name)
                    assert all(m.shape == master.shape for m in moments.values())
                else:
                    assert not moments and not scalars
        for name, c in cover.items():
            assert torch.equal(c, torch.ones_like(c)), f"stage {stage}: {name} not covered exactly once"
        assert any(not t for t in trainable.values()) and "head.weight" not in shapes  # frozen; tied alias
        for rank in range(2):
            r = res[rank][stage]
            for name, shape in shapes.items():  # every rank's model holds the loaded values
                assert np.array_equal(r["loaded"][name], _value(name, shape, [(0, d) for d in shape])), (stage, name)
            for name, _box, _master, moments, scalars in r["after"][0]:
                if trainable[name]:  # the optimizer state is exactly what was given
                    assert set(moments) == {"exp_avg"} and np.all(moments["exp_avg"] == 0.5)
                    assert scalars == {"step": 7.0}
            assert r["failed"] is not None and r["failed"][0] == 1 and "no such piece on rank 1" in r["failed"][1]
