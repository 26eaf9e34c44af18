"""Pairwise (isend/irecv) all-gather and reduce-scatter on gloo equal the flat collectives."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist_harness import run_ranks
from zeal.dist.comm import Comm, all_gather_flat, reduce_scatter_flat
from zeal.dist.context import init_distributed

pytestmark = pytest.mark.timeout(120)


def _run(rank, world):
    ctx = init_distributed()
    comm = Comm(ctx)
    assert comm.pairwise  # gloo
    gen = torch.Generator().manual_seed(rank)
    sizes = [world * n for n in (1, 7, 1000, 50_003)]
    for dtype in (torch.float32, torch.bfloat16):
        # several of each in flight at once, waited on in reverse order
        fulls = [torch.randn(n, generator=gen).to(dtype) for n in sizes]
        outs = [torch.empty(n // world, dtype=dtype) for n in sizes]
        works = [comm.reduce_scatter(o, f, "grad", async_op=True) for o, f in zip(outs, fulls)]
        shards = [torch.randn(n // world, generator=gen).to(dtype) for n in sizes]
        gathered = [torch.empty(n, dtype=dtype) for n in sizes]
        works += [comm.all_gather(g, s, "param", async_op=True) for g, s in zip(gathered, shards)]
        for w in reversed(works):
            w.wait()
        for f, o, s, g in zip(fulls, outs, shards, gathered):
            ref_rs = torch.empty_like(o)
            reduce_scatter_flat(ref_rs, f.clone())
            ref_ag = torch.empty_like(g)
            all_gather_flat(ref_ag, s)
            assert torch.equal(g, ref_ag)
            # the same world terms summed in another order: equal up to rounding, at most
            # (world - 1) roundings of partial sums (|terms| < 6, so bf16's are < 6 * 2^-8 each)
            if dtype == torch.float32:
                torch.testing.assert_close(o, ref_rs, rtol=1e-6, atol=1e-6)
            else:
                assert (o.float() - ref_rs.float()).abs().max() <= 2 * (world - 1) * 6 * 2 ** -8
        # in place: this rank's shard is already its chunk of the output (stages 1-2)
        full = torch.zeros(sizes[2], dtype=dtype)
        n = sizes[2] // world
        full[rank * n:(rank + 1) * n] = rank + 1
        comm.all_gather(full, full[rank * n:(rank + 1) * n], "param")
        assert torch.equal(full, torch.arange(1, world + 1, dtype=dtype).repeat_interleave(n))
    # accounting is that of the flat collectives: (N-1)/N of the buffer per rank
    total = comm.stats.report()["total"]
    dist.barrier()
    return total


@pytest.mark.parametrize("world", [2, 3, 4])
def test_pairwise_collectives_equal_flat_ones(world):
    results = run_ranks(_run, world, timeout=100)
    assert results[0] == results[-1]
