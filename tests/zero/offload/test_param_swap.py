"""Stage-3 parameter shards on disk: bounded buffer pool, prefetch, write-back ordering."""

from __future__ import annotations

import os

import pytest
import torch

from zeal.zero.offload.param_swap import ParamSwapper

pytestmark = pytest.mark.timeout(60)


def test_fetch_prefetch_release_within_buffer_count(tmp_path):
    sizes = {f"layer{i}.weight": 1000 + 37 * i for i in range(6)}
    data = {k: torch.randn(n, dtype=torch.bfloat16) for k, n in sizes.items()}
    with ParamSwapper(sizes, tmp_path, buffer_count=2, buffer_size=2000, dtype=torch.bfloat16) as ps:
        for k, v in data.items():
            ps.write(k, v)
        names = list(sizes)
        # forward order with one-ahead prefetch, as an engine with a recorded trace would do
        assert ps.prefetch(names[0])
        for i, name in enumerate(names):
            w = ps.fetch(name)
            if i + 1 < len(names):
                assert ps.prefetch(names[i + 1])
            assert not ps.prefetch("layer5.weight") or ps.is_resident("layer5.weight")
            assert torch.equal(w, data[name])
            ps.release(name)
        assert ps.max_in_use == 2 and ps.num_in_use == 0
        assert ps.cpu_bytes == 2 * 2 * max(sizes.values())  # bf16 buffers, sized to the largest shard
        assert ps.disk_bytes == 2 * sum(sizes.values())
        # all buffers held: fetch fails with the config key, prefetch declines
        ps.fetch(names[0])
        ps.fetch(names[1])
        assert not ps.prefetch(names[2])
        with pytest.raises(RuntimeError, match="offload_param.buffer_count"):
            ps.fetch(names[2])


def test_write_back_then_buffer_reuse(tmp_path):
    sizes = {"a": 3000, "b": 3000}
    with ParamSwapper(sizes, tmp_path, buffer_count=1, buffer_size=3000) as ps:
        ps.write("a", torch.zeros(3000))
        ps.write("b", torch.ones(3000))
        a = ps.fetch("a")
        a.add_(5.0)  # e.g. the optimizer updated this shard
        ps.release("a", write_back=True)
        b = ps.fetch("b")  # same buffer: must wait for a's write-back before reading b
        assert bool((b == 1).all())
        ps.release("b")
        assert bool((ps.fetch("a") == 5).all())
        with pytest.raises(RuntimeError, match="resident"):
            ps.write("a", torch.zeros(3000))
        folder = ps.store.folder
    assert not os.path.exists(folder)


def test_config_errors(tmp_path):
    with pytest.raises(ValueError, match="offload_param.buffer_size .* 'big'"):
        ParamSwapper({"small": 10, "big": 500}, tmp_path, buffer_size=100)
    with pytest.raises(ValueError, match="offload_param.buffer_count"):
        ParamSwapper({"a": 10}, tmp_path, buffer_count=0)
    with pytest.raises(ValueError, match="offload_param.nvme_path"):
        ParamSwapper({"a": 10}, tmp_path / "missing")
