"""The device mesh: group layout (pure), real groups on 4 gloo ranks, and every
collective of a training step accounted."""

from __future__ import annotations

import pytest
import torch

from tests.dist_harness import run_ranks
from zeal.dist.mesh import layout, node_layout


def test_layout_megatron_order_8_ranks():
    g = layout(8, tp=2, pp=2)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_layout_expert_groups_follow_deepspeed_ted():
    # W = 16, tp = 2, ep = 4: the example of DeepSpeed-TED's layout (algorithms.md §12.1)
    g = layout(16, tp=2, ep=4)
    assert g["dp"][:2] == [[0, 2, 4, 6, 8, 10, 12, 14], [1, 3, 5, 7, 9, 11, 13, 15]]
    assert g["ep"] == [[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]]
    assert g["edp"][:4] == [[0, 8], [2, 10], [4, 12], [6, 14]]


def test_layout_every_dimension_partitions_the_world():
    for world, tp, pp, ep in [(8, 2, 2, 2), (8, 1, 1, 4), (12, 3, 2, 2), (1, 1, 1, 1)]:
        for dim, groups in layout(world, tp, pp, ep).items():
            flat = sorted(r for grp in groups for r in grp)
            assert flat == list(range(world)), (dim, world, tp, pp, ep)
            assert len({len(grp) for grp in groups}) == 1, dim


@pytest.mark.parametrize("sizes, msg", [
    ({"world": 6, "tp": 4}, "does not divide world size 6"),
    ({"world": 8, "tp": 2, "ep": 3}, "expert parallel 3 does not divide the data-parallel size 4"),
    ({"world": 4, "pp": 0}, "pp=0"),
])
def test_layout_refuses_sizes_that_do_not_tile(sizes, msg):
    with pytest.raises(ValueError, match=msg):
        layout(sizes.pop("world"), **sizes)


def test_node_layout_zeropp_groups():
    # 4 ranks, 2 per node, hpZ 2: intra = node, inter = same local index, hpz = node here
    g = node_layout([[0, 1, 2, 3]], local_world_size=2, hpz=2)
    assert g == {"intra": [[0, 1], [2, 3]], "inter": [[0, 2], [1, 3]], "hpz": [[0, 1], [2, 3]]}
    with pytest.raises(ValueError, match="zero_hpz_partition_size 3 does not divide"):
        node_layout([[0, 1, 2, 3]], 2, hpz=3)


def _mesh_groups(rank: int, world: int, tp: int, ep: int) -> dict:
    from zeal.dist.mesh import build_mesh

    mesh = build_mesh(dp=world // tp, tp=tp, ep=ep)  # joins torchrun's job
    out = {"coords": {d: getattr(mesh, f"{d}_rank") for d in ("dp", "tp", "pp", "ep")},
           "sizes": {d: getattr(mesh, f"{d}_size") for d in ("dp", "tp", "pp", "ep")}}
    for dim in ("dp", "tp", "ep", "edp"):
        comm = mesh.comm(dim)
        t = torch.tensor([float(rank)])
        comm.all_reduce(t, "control")  # the group really is these ranks: the sum says so
        out[dim] = (comm.ranks, float(t))
    return out


def _expected(groups: list[list[int]], rank: int) -> tuple[list[int], float]:
    """The group holding ``rank`` and what an all-reduce of the rank ids over it gives."""
    g = next(g for g in groups if rank in g)
    return g, float(sum(g))


@pytest.mark.timeout(120)
def test_mesh_groups_on_4_ranks():
    # dp x tp = 2 x 2
    res = run_ranks(_mesh_groups, 4, 2, 1, timeout=90)
    for r, out in enumerate(res):
        assert out["tp"] == _expected([[0, 1], [2, 3]], r)
        assert out["dp"] == _expected([[0, 2], [1, 3]], r)
        assert out["coords"] == {"dp": r // 2, "tp": r % 2, "pp": 0, "ep": 0}
        assert out["sizes"] == {"dp": 2, "tp": 2, "pp": 1, "ep": 1}
    # ep x edp = 2 x 2 over a data-parallel group of 4 (expert parallelism splits dp)
    res = run_ranks(_mesh_groups, 4, 1, 2, timeout=90)
    for r, out in enumerate(res):
        assert out["ep"] == _expected([[0, 1], [2, 3]], r)
        assert out["edp"] == _expected([[0, 2], [1, 3]], r)
        assert out["dp"] == ([0, 1, 2, 3], 6.0)
        assert out["sizes"] == {"dp": 4, "tp": 1, "pp": 1, "ep": 2}
        assert out["coords"]["ep"] == r % 2


# ------------------------------------------------------------- every collective is accounted

class _Wire:
    """Wraps torch.distributed's send and collective functions and counts the bytes this
    process sends: point-to-point sends by their size, collectives by the
    bandwidth-optimal volume of zeal.dist.comm's convention ((N-1)/N of the tensor for
    gathers, scatters and broadcasts, twice that for all-reduce)."""

    COLLECTIVES = {"all_reduce": 2, "broadcast": 1, "all_gather_into_tensor": 1, "all_gather_single": 1,
                   "reduce_scatter_tensor": 1, "reduce_scatter_single": 1, "all_to_all_single": 1}

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist, self.bytes, self.calls, self.saved = dist, 0, {}, {}
        for name in ("isend", "send"):
            self._wrap(name, lambda t, *a, **k: t.numel() * t.element_size())
        for name, factor in self.COLLECTIVES.items():
            self._wrap(name, self._collective_bytes(name, factor))
        for name in ("all_gather", "gather", "scatter", "reduce_scatter", "all_to_all", "batch_isend_irecv",
                     "reduce", "all_gather_object", "broadcast_object_list", "barrier"):
            self._wrap(name, lambda *a, _n=name, **k: self._untracked(_n))

    def _collective_bytes(self, name: str, factor: int):
        def size(*args, group=None, **kwargs):
            n = self.dist.get_world_size(group)
            # the largest tensor argument is the full one (output of a gather, input of a scatter)
            t = max((a for a in args if isinstance(a, torch.Tensor)), key=lambda a: a.numel())
            return factor * (t.numel() * t.element_size() // n) * (n - 1)
        return size

    def _untracked(self, name: str) -> int:
        raise AssertionError(f"zeal called torch.distributed.{name}, which the test does not measure")

    def _wrap(self, name: str, nbytes) -> None:
        fn = getattr(self.dist, name, None)
        if fn is None:
            return
        self.saved[name] = fn

        def wrapped(*args, **kwargs):
            self.bytes += nbytes(*args, **kwargs)
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        setattr(self.dist, name, wrapped)

    def close(self) -> None:
        for name, fn in self.saved.items():
            setattr(self.dist, name, fn)


def _step_bytes(rank: int, world: int, configs: list[dict]) -> list:
    import zeal
    from zeal.models import GPT, GPTConfig

    out = []
    for zc in configs:
        cfg = GPTConfig(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=2)
        engine = zeal.initialize(lambda cfg=cfg: GPT(cfg), {
            "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
            "zero_optimization": {**zc, "stage3_param_persistence_threshold": 0},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
        g = torch.Generator().manual_seed(rank)
        for step in range(2):
            wire = _Wire() if step == 1 else None
            try:
                for _ in range(2):
                    x = torch.randint(0, 96, (2, 16), generator=g)
                    engine.backward(engine({"input_ids": x, "labels": x}))
                    engine.step()
            finally:
                if wire is not None:
                    wire.close()
        stats = engine.comm_stats()["last_step"]
        counted = sum(v["bytes"] for v in stats["by_kind"].values())
        by_dim = {k: v["bytes"] for k, v in stats["by_dim"].items()}
        out.append((wire.bytes, counted, wire.calls, by_dim))
        engine.close()
    return out


@pytest.mark.timeout(180)
def test_every_collective_of_a_step_is_counted():
    configs = [{"stage": 0}, {"stage": 1}, {"stage": 2}, {"stage": 3},
               {"stage": 3, "zero_quantized_weights": True}]
    res = run_ranks(_step_bytes, 2, configs, timeout=150)
    for zc, *per_rank in zip(configs, *res):
        for sent, counted, calls, by_dim in per_rank:
            assert sent > 0, (zc, calls)
            assert counted == sent, (zc, counted, sent, calls)
            assert set(by_dim) == {"dp"}, by_dim  # ZeRO's traffic runs over the data-parallel Comm


def test_layout_sequence_parallel_groups_are_consecutive_inside_dp():
    # DeepSpeed's sequence_data_parallel arrangement: sp groups are consecutive members of
    # the dp group (ranks tp apart), ZeRO's dp group spans data x sp
    g = layout(8, tp=2, sp=2)
    assert g["dp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["sp"] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert layout(4, sp=4)["sp"] == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="sequence_parallel_size 3 does not divide the data-parallel size 4"):
        layout(8, tp=2, sp=3)
