"""Disk tier: SwapStore round trips, start-up checks, clean-up, and the swapped Adam step."""

from __future__ import annotations

import gc
import os
from collections import namedtuple

import pytest
import torch

from zeal.zero.offload import (
    OPTIMIZER_PATH_KEY,
    AdamState,
    CPUAdam,
    SwappedAdam,
    SwapStore,
    aligned_empty,
    sub_group_ranges,
)
from zeal.zero.offload import swap as swap_mod

pytestmark = pytest.mark.timeout(60)


def swap_dirs(path) -> list[str]:
    return [e for e in os.listdir(path) if e.startswith("zeal-swap-")]


@pytest.mark.parametrize("direct_io", [True, False])
def test_store_round_trip_aligned_and_not(tmp_path, direct_io):
    sizes = {"a": 5000, "b": 1, "c": 0, "d": 2048}
    with SwapStore(tmp_path, sizes, direct_io=direct_io) as store:
        assert len(swap_dirs(tmp_path)) == 1
        x = torch.randn(5000)
        aligned = aligned_empty(5000)
        aligned.copy_(x)
        store.write("a", aligned)  # aligned memory: O_DIRECT bulk + buffered tail
        out = torch.empty(5000)  # unaligned memory: buffered path
        store.read("a", out)
        assert torch.equal(out, x)
        store.write("a", x[:7].clone(), offset=4000)  # partial, unaligned file offset
        part = aligned_empty(1000)
        store.read("a", part, offset=4000)
        assert torch.equal(part[:7], x[:7]) and torch.equal(part[7:], x[4007:])
        d = aligned_empty(2048)
        d.copy_(torch.arange(2048.0))
        futures = [store.write_async("d", d), store.read_async("d", out[:2048])]
        for f in futures:
            f.result()
        assert torch.equal(out[:2048], d)
        store.write("b", torch.tensor([3.0]))
        assert store.bytes_written == 4 * (5000 + 7 + 2048 + 1)
        with pytest.raises(ValueError, match="outside"):
            store.read("d", torch.empty(10), offset=2040)
        with pytest.raises(TypeError):
            store.write("d", torch.zeros(4, dtype=torch.float64))
    assert swap_dirs(tmp_path) == []
    assert store.closed
    with pytest.raises(RuntimeError, match="closed"):
        store.read("a", out)


def test_large_transfers_split_into_parallel_pieces(tmp_path):
    n = 5 * 2**20 + 3  # 20 MiB + a ragged tail: two O_DIRECT pieces and a buffered tail
    with SwapStore(tmp_path, {"big": n}, io_parallelism=4) as store:
        x = aligned_empty(n)
        x.copy_(torch.randn(n))
        store.write("big", x)
        out = aligned_empty(n)
        store.read("big", out)
        assert torch.equal(out, x) and store.bytes_read == 4 * n


def test_async_ordering_per_name_and_after(tmp_path):
    n = 1 << 18
    with SwapStore(tmp_path, {"a": n, "b": n}) as store:
        x, y = aligned_empty(n), aligned_empty(n)
        x.fill_(1.0)
        y.fill_(2.0)
        out1, out2, out3 = aligned_empty(n), aligned_empty(n), aligned_empty(n)
        fs = [store.write_async("a", x), store.read_async("a", out1),  # RAW on "a"
              store.write_async("a", y), store.read_async("a", out2)]  # WAR then RAW
        w = store.write_async("b", x)
        fs.append(store.read_async("a", x, after=[w]))  # memory: x is refilled after "b" copied it
        fs.append(store.read_async("b", out3))
        for f in fs:
            f.result()
        assert bool((out1 == 1).all()) and bool((out2 == 2).all())
        assert bool((out3 == 1).all()) and bool((x == 2).all())
        failed = store.submit(lambda: 1 / 0)
        dependent = store.read_async("a", out1, after=[failed])
        with pytest.raises(ZeroDivisionError):
            dependent.result()


def test_missing_unwritable_and_not_a_dir(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=f"{OPTIMIZER_PATH_KEY}: '.*nope' does not exist"):
        SwapStore(tmp_path / "nope", {"a": 4})
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        SwapStore(tmp_path / "file", {"a": 4})
    with pytest.raises(ValueError, match="must be set"):
        SwapStore("", {"a": 4})
    monkeypatch.setattr(swap_mod.os, "access", lambda path, mode: False)
    with pytest.raises(ValueError, match=f"{OPTIMIZER_PATH_KEY}: .* is not writable"):
        SwapStore(tmp_path, {"a": 4})


def test_too_little_disk_fails_before_writing(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(swap_mod.shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(ValueError, match=r"not enough free disk .* need 0\.00 GiB"):
        SwapStore(tmp_path, {"a": 200, "b": 100})
    assert swap_dirs(tmp_path) == []
    with pytest.raises(ValueError, match="zero_optimization.offload_param.nvme_path"):
        SwapStore(tmp_path, {"a": 10**6}, config_key=swap_mod.PARAM_PATH_KEY)
    SwapStore(tmp_path, {"a": 250}).close()  # exactly 1000 bytes fits


def test_files_removed_on_gc_and_stale_folders(tmp_path):
    store = SwapStore(tmp_path, {"a": 10})
    folder = store.folder
    assert os.path.exists(os.path.join(folder, "a.bin"))
    del store
    gc.collect()
    assert not os.path.exists(folder)
    # a folder left by a killed process (its lock is free) is removed at start-up;
    # a live store's folder (locked) and folders without a lock file are left alone
    stale = tmp_path / "zeal-swap-999999999-abc"
    stale.mkdir()
    (stale / ".lock").write_bytes(b"")
    (stale / "param.0.bin").write_bytes(b"1234")
    unlocked = tmp_path / "zeal-swap-being-created"
    unlocked.mkdir()
    with SwapStore(tmp_path, {"a": 1}) as live:
        assert not stale.exists() and unlocked.exists()
        with SwapStore(tmp_path, {"b": 1}):
            assert os.path.exists(os.path.join(live.folder, "a.bin"))


def test_sub_group_ranges():
    assert sub_group_ranges(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert sub_group_ranges(8, 8) == [(0, 8)]
    assert sub_group_ranges(0, 8) == []
    with pytest.raises(ValueError, match="sub_group_size"):
        sub_group_ranges(10, 0)


N = 10_007


def reference_run(p0, grads, opt_kw, steps):
    opt, p, state = CPUAdam(**opt_kw), p0.clone(), AdamState.zeros_like(p0)
    out = []
    for t in range(steps):
        opt.update(p, grads[t], state)
        out.append(p.clone())
    return out


@pytest.mark.parametrize("sub_group_size,buffer_count,swap_grads", [
    (N, 3, False),      # one sub-group, sequential
    (4096, 3, False),   # one slot: no overlap
    (1000, 6, False),   # two slots: read-ahead
    (777, 9, False),    # three slots, ragged sizes
    (333, 100, True),   # more slots than needed, gradients swapped too
])
def test_swapped_step_equals_in_memory(tmp_path, sub_group_size, buffer_count, swap_grads):
    steps = 5
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(N, generator=gen)
    grads = [torch.randn(N, generator=gen) for _ in range(steps)]
    kw = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.05)
    ref = reference_run(p0, grads, kw, steps)
    with SwappedAdam(N, CPUAdam(**kw), str(tmp_path), sub_group_size=sub_group_size,
                     buffer_count=buffer_count, swap_grads=swap_grads) as opt:
        opt.write_master(p0)
        compute = torch.zeros(N)  # the "device" copy, refreshed by on_update
        for t in range(steps):
            if swap_grads:
                opt.write_state("grad", grads[t])
            stats = opt.step(None if swap_grads else grads[t],
                             on_update=lambda lo, chunk: compute[lo:lo + chunk.numel()].copy_(chunk))
            assert torch.equal(compute, ref[t]), t
            moment_reads = 0 if t == 0 else 8 * N
            assert stats.bytes_read == 4 * N + moment_reads + (4 * N if swap_grads else 0)
            assert stats.bytes_written == 12 * N
        master = torch.empty(N)
        opt.read_master(master)
        assert torch.equal(master, ref[-1])
        assert opt.steps == [steps] * len(opt.ranges)
        assert opt.slots == min(buffer_count // (4 if swap_grads else 3), len(opt.ranges))
        assert opt.cpu_bytes == opt.slots * opt.per_slot * 4 * min(sub_group_size, N)
        assert opt.disk_bytes == opt.per_slot * 4 * N
        folder = opt.store.folder
    assert not os.path.exists(folder)


def test_moments_stream_out_and_back_for_checkpoints(tmp_path):
    kw = dict(lr=1e-2, weight_decay=0.1)
    n = 3000
    p0, g = torch.randn(n), [torch.randn(n) for _ in range(4)]
    a = SwappedAdam(n, CPUAdam(**kw), str(tmp_path), sub_group_size=1024, buffer_count=6)
    a.write_master(p0)
    fresh_m = torch.ones(n)
    a.read_state("exp_avg", fresh_m)  # never updated: zeros, nothing read
    assert torch.equal(fresh_m, torch.zeros(n))
    for t in range(2):
        a.step(g[t])
    saved = {s: torch.empty(n) for s in ("param", "exp_avg", "exp_avg_sq")}
    for s, t in saved.items():
        a.read_state(s, t)
    b = SwappedAdam(n, CPUAdam(**kw), str(tmp_path), sub_group_size=1000, buffer_count=3)
    for s, t in saved.items():  # different sub-grouping: layout is flat
        b.write_state(s, t[:1500], 0)
        b.write_state(s, t[1500:], 1500)
    b.set_steps([2] * len(b.ranges))
    for t in range(2, 4):
        a.step(g[t])
        b.step(g[t])
    pa, pb = torch.empty(n), torch.empty(n)
    a.read_master(pa)
    b.read_master(pb)
    assert torch.equal(pa, pb)
    a.close()
    b.close()
    assert swap_dirs(tmp_path) == []


def test_bad_buffer_count_and_grads(tmp_path):
    with pytest.raises(ValueError, match="zero_optimization.offload_optimizer.buffer_count must be >= 3"):
        SwappedAdam(10, CPUAdam(), str(tmp_path), buffer_count=2)
    with SwappedAdam(10, CPUAdam(), str(tmp_path), buffer_count=4, swap_grads=False) as opt:
        with pytest.raises(ValueError, match="grads"):
            opt.step(torch.zeros(9))
        with pytest.raises(ValueError):
            opt.step(None)


def test_error_in_update_leaves_no_io_running(tmp_path):
    with SwappedAdam(4000, CPUAdam(), str(tmp_path), sub_group_size=500, buffer_count=9) as opt:
        opt.write_master(torch.zeros(4000))

        def fail(lo, chunk):
            if lo == 1000:
                raise RuntimeError("copy to device failed")

        with pytest.raises(RuntimeError, match="copy to device failed"):
            opt.step(torch.ones(4000), on_update=fail)
        assert opt.store.submit(lambda: 7).result() == 7  # the I/O queue is idle and usable
    assert swap_dirs(tmp_path) == []
