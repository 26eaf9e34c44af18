"""Block quantizer properties (hypothesis) and the quantized collectives on 4 gloo ranks."""

from __future__ import annotations

import datetime

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from tests.dist_harness import run_ranks
from zeal.dist.quant import (
    dequantize,
    error_bound,
    quantize,
    quantized_all_gather,
    quantized_nbytes,
    quantized_reduce_scatter,
)

pytestmark = pytest.mark.timeout(60)
QMAX = {8: 127, 4: 7}


def block_absmax(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per-element absmax of the block holding it (reference, plain loop-free torch)."""
    n = x.numel()
    nb = -(-n // block_size)
    padded = torch.zeros(nb * block_size)
    padded[:n] = x.float().abs()
    return padded.view(nb, block_size).amax(1).repeat_interleave(block_size)[:n]


finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True)


@pytest.mark.timeout(60)
@settings(max_examples=300, deadline=None)
@given(x=arrays(np.float32, st.integers(1, 300), elements=finite32),
       bits=st.sampled_from([4, 8]), block_size=st.integers(1, 70))
def test_every_element_within_bound(x, bits, block_size):
    t = torch.from_numpy(x)
    q = quantize(t, bits, block_size)
    back = dequantize(q)
    assert back.shape == t.shape and back.dtype == torch.float32
    err = (back.double() - t.double()).abs()
    bound = error_bound(block_absmax(t, block_size).double(), bits)
    assert bool((err <= bound).all()), float((err - bound).max())
    assert q.nbytes == quantized_nbytes(t.numel(), bits, block_size)


@pytest.mark.timeout(60)
@settings(max_examples=200, deadline=None)
@given(data=st.data(), bits=st.sampled_from([4, 8]), block_size=st.integers(1, 40),
       nblocks=st.integers(1, 6))
def test_representable_values_round_trip_exactly(data, bits, block_size, nblocks):
    qmax = QMAX[bits]
    tail = data.draw(st.integers(1, block_size))  # ragged last block
    sizes = [block_size] * (nblocks - 1) + [tail]
    blocks = []
    for size in sizes:
        k = torch.tensor(data.draw(st.lists(st.integers(-qmax, qmax), min_size=size, max_size=size)))
        k[data.draw(st.integers(0, size - 1))] = qmax * data.draw(st.sampled_from([-1, 1]))
        mantissa = data.draw(st.integers(1, 1023))  # step = m * 2^e: k*step exact in fp32
        step = mantissa * 2.0 ** data.draw(st.integers(-100, 100))
        blocks.append(k.double() * step)
    x = torch.cat(blocks).float()
    assert torch.equal(dequantize(quantize(x, bits, block_size)), x)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bits", [4, 8])
def test_zero_blocks_and_shapes(bits):
    x = torch.zeros(5, 7)
    x[3:, :] = torch.randn(2, 7)
    q = quantize(x, bits, block_size=8)  # first block all zero
    assert q.scales[0] == 0
    back = dequantize(q)
    assert back.shape == (5, 7)
    assert torch.equal(back[:1], torch.zeros(1, 7))
    assert torch.equal(dequantize(quantize(torch.zeros(13), bits, 4)), torch.zeros(13))
    bf = torch.randn(33, dtype=torch.bfloat16)
    out = dequantize(quantize(bf, bits, 16), dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (33,)


@pytest.mark.timeout(30)
def test_int4_packing_layout():
    codes = torch.tensor([-7, 7, 3, -1, 0])  # odd length: last byte half padding
    q = quantize(codes.float(), bits=4, block_size=5)
    assert q.data.dtype == torch.uint8 and q.data.numel() == 3
    # first element in the high nibble, two's complement nibbles
    assert q.data.tolist() == [(9 << 4) | 7, (3 << 4) | 15, 0]
    assert torch.equal(dequantize(q), codes.float())
    i8 = quantize(codes.float(), bits=8, block_size=5)
    assert i8.data.dtype == torch.int8 and i8.data.numel() == 5


def test_invalid_arguments():
    with pytest.raises(ValueError, match="bits"):
        quantize(torch.ones(4), bits=3)
    with pytest.raises(ValueError, match="block_size"):
        quantize(torch.ones(4), bits=8, block_size=0)


def test_alone_collectives_degenerate():
    x = torch.randn(40)
    assert torch.equal(quantized_all_gather(x, None, 8, 16), dequantize(quantize(x, 8, 16)))
    assert torch.equal(quantized_reduce_scatter(x, None, None, bits=4, block_size=16), x)


# -- 4 gloo ranks: 2 simulated nodes x 2 local ranks ---------------------------------------

NODES, LOCAL = 2, 2
WORLD = NODES * LOCAL


def rank_grad(r: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + r)
    return torch.randn(numel, generator=g) * (1.0 + r)


def qgz_bound(grads: list[torch.Tensor], bits: int, bs: int) -> torch.Tensor:
    """Per-element bound of algorithms.md §4.6 for the whole (P·c) output, as fp64."""
    numel = grads[0].numel()
    c = numel // WORLD
    e = lambda a: error_bound(a.double(), bits)  # noqa: E731
    total = torch.zeros(numel, dtype=torch.float64)
    slack = torch.zeros(numel, dtype=torch.float64)
    for n in range(NODES):
        e1_node = torch.zeros(numel, dtype=torch.float64)
        node_sum = torch.zeros(numel, dtype=torch.float64)
        for d in range(LOCAL):
            g = grads[n * LOCAL + d]
            # hop-1 row for local index j is [partition (n', j) for n'] of this rank's grad
            rows = g.view(NODES, LOCAL, c).transpose(0, 1).reshape(LOCAL, NODES * c)
            a1 = torch.stack([block_absmax(rows[j], bs) for j in range(LOCAL)])
            e1_node += e(a1).view(LOCAL, NODES, c).transpose(0, 1).reshape(-1)
            node_sum += g.double()
            slack += g.double().abs()
        # hop-2 rows are partitions of the (dequantized) node sum; bound its absmax
        a2 = torch.cat([block_absmax(part.float(), bs) for part in node_sum.view(WORLD, c)]).double()
        a2_blk = torch.cat([block_absmax(part, bs) for part in e1_node.float().view(WORLD, c)]).double()
        total += e1_node + e(a2 + a2_blk)
    return (total + 1e-5 * slack) / WORLD


def _worker(rank: int, world: int) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))  # torchrun's variables
    try:
        intra = inter = None
        for n in range(NODES):
            g = dist.new_group([n * LOCAL + d for d in range(LOCAL)])
            intra = g if rank // LOCAL == n else intra
        for d in range(LOCAL):
            g = dist.new_group([n * LOCAL + d for n in range(NODES)])
            inter = g if rank % LOCAL == d else inter

        # qwZ: gathered chunk r == local round trip of rank r's shard, within the bound
        for bits, bs, numel in [(8, 64, 1000), (4, 7, 333)]:
            shard = rank_grad(rank, numel)
            log = []
            got = quantized_all_gather(shard, dist.group.WORLD, bits, bs,
                                       record=lambda op, n, b, log=log: log.append((op, n, b)))
            full = torch.empty(WORLD * numel)
            dist.all_gather_into_tensor(full, shard)
            for r in range(WORLD):
                ref = rank_grad(r, numel)
                chunk = got[r * numel:(r + 1) * numel]
                assert torch.equal(chunk, dequantize(quantize(ref, bits, bs)))
                assert torch.equal(full[r * numel:(r + 1) * numel], ref)
            err = (got - full).abs().double()
            bound = error_bound(torch.cat([block_absmax(full[r * numel:(r + 1) * numel], bs)
                                           for r in range(WORLD)]).double(), bits)
            assert bool((err <= bound).all())
            assert log == [("qwz_all_gather", WORLD, 3 * quantized_nbytes(numel, bits, bs))]
        local = quantized_all_gather(torch.full((10,), float(rank)), intra, 8, 4)
        node = rank // LOCAL
        assert torch.equal(local, torch.arange(node * LOCAL, node * LOCAL + LOCAL).float().repeat_interleave(10))

        # qgZ: compare with reduce-scatter mean
        c = 300
        numel = WORLD * c
        grads = [rank_grad(r, numel) for r in range(WORLD)]
        mean = torch.empty(c)
        dist.reduce_scatter_tensor(mean, grads[rank].clone())
        mean /= WORLD
        exact = quantized_reduce_scatter(grads[rank], intra, inter, bits=None)
        torch.testing.assert_close(exact, mean, rtol=1e-6, atol=1e-6)
        for bits, bs in [(8, 64), (4, 64), (4, 300), (8, 1)]:
            log = []
            out = quantized_reduce_scatter(grads[rank], intra, inter, bits=bits, block_size=bs,
                                           record=lambda op, n, b, log=log: log.append((op, n, b)))
            assert out.shape == (c,) and out.dtype == torch.float32
            bound = qgz_bound(grads, bits, bs)[rank * c:(rank + 1) * c]
            err = (out.double() - mean.double()).abs()
            assert bool((err <= bound).all()), (bits, bs, float((err - bound).max()))
            assert err.max() > 0 or bs == 1
            assert log == [("qgz_intra_all_to_all", LOCAL, quantized_nbytes(NODES * c, bits, bs)),
                           ("qgz_inter_all_to_all", NODES, quantized_nbytes(c, bits, bs))]
        with_bad = None
        try:
            quantized_reduce_scatter(torch.ones(WORLD * 3 + 1), intra, inter)
        except ValueError as exc:
            with_bad = exc
        assert with_bad is not None
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(240)
def test_quantized_collectives_on_4_ranks():
    run_ranks(_worker, WORLD, timeout=200, local_world=LOCAL)
