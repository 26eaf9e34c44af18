"""Paged attention equals dense causal attention, for decode tokens and prompt chunks."""

from __future__ import annotations

import pytest
import torch

from zeal.inference.attention import (
    AttentionMetadata,
    PrefillChunk,
    chunk_attention,
    paged_attention,
    plan_decodes,
)
from zeal.models.llama import dense_causal_attention


@pytest.mark.timeout(30)
@pytest.mark.parametrize("nh,nkv", [(4, 4), (4, 2), (6, 1)])
def test_paged_equals_dense(nh, nkv):
    torch.manual_seed(0)
    hd, bs, nblocks = 8, 4, 64
    lens = [1, 5, 13, 20]  # per sequence: total tokens
    split = [0, 3, 13, 19]  # tokens already in cache before this pass (19 -> a decode token)
    perm = torch.randperm(nblocks).tolist()  # blocks scattered over the cache
    tables, used = [], 0
    for n in lens:
        k = -(-n // bs)
        tables.append(perm[used : used + k])
        used += k
    qs = [torch.randn(n, nh, hd) for n in lens]
    ks = [torch.randn(n, nkv, hd) for n in lens]
    vs = [torch.randn(n, nkv, hd) for n in lens]
    kc = torch.zeros(nblocks, nkv, bs, hd)
    vc = torch.zeros(nblocks, nkv, bs, hd)

    def slots(t, a, b):
        return [t[p // bs] * bs + p % bs for p in range(a, b)]

    # pass 1: the cached part of each sequence (a prompt chunk each)
    first = [i for i, s in enumerate(split) if s > 0]
    q1 = torch.cat([qs[i][: split[i]] for i in first])
    k1 = torch.cat([ks[i][: split[i]] for i in first])
    v1 = torch.cat([vs[i][: split[i]] for i in first])
    meta1 = AttentionMetadata(torch.tensor(sum((slots(tables[i], 0, split[i]) for i in first), [])))
    row = 0
    for i in first:
        meta1.prefills.append(PrefillChunk(row, split[i], split[i], torch.tensor(tables[i])))
        row += split[i]
    out1 = paged_attention(q1, k1, v1, kc, vc, meta1)
    # pass 2: the rest; sequence 3 has one token left (decode path), others are chunks
    q2 = torch.cat([qs[i][split[i] :] for i in range(4)])
    k2 = torch.cat([ks[i][split[i] :] for i in range(4)])
    v2 = torch.cat([vs[i][split[i] :] for i in range(4)])
    meta2 = AttentionMetadata(torch.tensor(sum((slots(tables[i], split[i], lens[i]) for i in range(4)), [])))
    row, dec = 0, []
    for i in range(4):
        n = lens[i] - split[i]
        if n == 1 and split[i] > 0:
            dec.append((row, tables[i], lens[i]))
        else:
            meta2.prefills.append(PrefillChunk(row, n, lens[i], torch.tensor(tables[i])))
        row += n
    meta2.decodes = plan_decodes([r for r, _, _ in dec], [t for _, t, _ in dec], [n for _, _, n in dec], bs)
    out2 = paged_attention(q2, k2, v2, kc, vc, meta2)

    row1 = row2 = 0
    for i in range(4):
        ref = dense_causal_attention(qs[i], ks[i], vs[i])
        if split[i]:
            torch.testing.assert_close(out1[row1 : row1 + split[i]], ref[: split[i]])
            row1 += split[i]
        n = lens[i] - split[i]
        torch.testing.assert_close(out2[row2 : row2 + n], ref[split[i] :])
        row2 += n


def _decode_case(nh, nkv, lens, tables, nblocks, hd=8, bs=4, seed=1):
    """Decode tokens of sequences with ``lens`` tokens (the last one new) and block ``tables``."""
    torch.manual_seed(seed)
    kc, vc = torch.zeros(nblocks, nkv, bs, hd), torch.zeros(nblocks, nkv, bs, hd)
    qs = [torch.randn(n, nh, hd) for n in lens]
    ks = [torch.randn(n, nkv, hd) for n in lens]
    vs = [torch.randn(n, nkv, hd) for n in lens]
    for i, n in enumerate(lens):  # the cached prefix of every sequence
        for p in range(n - 1):
            b = tables[i][p // bs]
            if kc[b, :, p % bs].any():  # a shared block: the same prefix must be there
                ks[i][p], vs[i][p] = kc[b, :, p % bs], vc[b, :, p % bs]
            kc[b, :, p % bs], vc[b, :, p % bs] = ks[i][p], vs[i][p]
    q = torch.stack([x[-1] for x in qs])
    k = torch.stack([x[-1] for x in ks])
    v = torch.stack([x[-1] for x in vs])
    slots = torch.tensor([tables[i][(n - 1) // bs] * bs + (n - 1) % bs for i, n in enumerate(lens)])
    return q, k, v, kc, vc, slots, qs, ks, vs


@pytest.mark.timeout(30)
@pytest.mark.parametrize("nh,nkv", [(4, 2), (6, 1), (3, 3)])
@pytest.mark.parametrize("layout", ["scattered", "packed", "mixed"])
def test_decodes_equal_dense(nh, nkv, layout):
    """Decode tokens of very different context lengths, their blocks read in place
    (packed runs), gathered (scattered), or both."""
    bs = 4
    lens = [2, 3, 9, 17, 30, 41, 5, 60]  # tokens per sequence; the last one is this pass's decode token
    counts = [-(-n // bs) for n in lens]
    nblocks = 800
    if layout == "scattered":  # every block 3+ away from the next: no run
        order = torch.randperm(200, generator=torch.Generator().manual_seed(3)).mul(4).tolist()
    elif layout == "packed":  # interleaved as decode steps allocate them, a few holes
        order = [b for b in range(nblocks) if b % 7 != 3]
    else:
        order = list(range(40)) + torch.randperm(120, generator=torch.Generator().manual_seed(4)).add(40).tolist()
    tables, used = [], 0
    for c in counts:
        tables.append(order[used : used + c])
        used += c
    q, k, v, kc, vc, slots, qs, ks, vs = _decode_case(nh, nkv, lens, tables, nblocks, bs=bs)
    meta = AttentionMetadata(slots, decodes=plan_decodes(list(range(len(lens))), tables, lens, bs,
                                                         max_gap=2, min_run=3))
    kinds = {seg.blocks is None for seg in meta.decodes.segments}
    assert kinds == {"scattered": {False}, "packed": {True}, "mixed": {True, False}}[layout]
    out = paged_attention(q, k, v, kc, vc, meta)
    for i in range(len(lens)):
        torch.testing.assert_close(out[i], dense_causal_attention(qs[i], ks[i], vs[i])[-1])


@pytest.mark.timeout(30)
def test_decodes_sharing_blocks_equal_dense():
    """Two decodes read the same prefix blocks (prefix caching, n > 1): the second
    reader's blocks are gathered, each sequence still sees exactly its own context."""
    bs, nh, nkv = 4, 4, 2
    lens = [14, 11, 9]
    tables = [[0, 1, 2, 3], [0, 1, 4], [0, 5, 6]]  # block 0 is shared by all, block 1 by two
    q, k, v, kc, vc, slots, qs, ks, vs = _decode_case(nh, nkv, lens, tables, 8, bs=bs)
    plan = plan_decodes([0, 1, 2], tables, lens, bs, min_run=1)
    assert sum(seg.owner.numel() for seg in plan.segments) == sum(-(-n // bs) for n in lens)
    out = paged_attention(q, k, v, kc, vc, AttentionMetadata(slots, decodes=plan))
    for i in range(len(lens)):
        torch.testing.assert_close(out[i], dense_causal_attention(qs[i], ks[i], vs[i])[-1])


def test_plan_decodes_runs_and_holes():
    # blocks 0-9 read by two decodes, 10-11 nobody's (a hole), 12-15 decode 0 again, 40 far away
    tables = [[0, 2, 4, 6, 8, 12, 13, 14, 15, 40], [1, 3, 5, 7, 9]]
    lens = [4 * 10 - 1, 4 * 5]
    plan = plan_decodes([7, 3], tables, lens, 4, max_gap=2, min_run=3)
    sliced = [s for s in plan.segments if s.blocks is None]
    gathered = [s for s in plan.segments if s.blocks is not None]
    assert [(s.start, s.stop) for s in sliced] == [(0, 16)]
    assert sliced[0].owner[10:12].tolist() == [2, 2]  # the hole reads with the zero query
    assert gathered[0].blocks.tolist() == [40] and gathered[0].owner.tolist() == [0]
    assert gathered[0].mask[0].tolist() == [False, False, False, True]  # 3 tokens in the last block
    assert plan.rows.tolist() == [7, 3]


@pytest.mark.parametrize("length,ctx", [(40, 40), (25, 70), (1, 9)])
def test_chunk_attention_reduced_precision_tiles(length, ctx):
    """The CPU bf16 path (grouped matmuls over query tiles) against fp32 SDPA."""
    torch.manual_seed(2)
    nh, nkv, hd = 6, 2, 16
    q, k, v = torch.randn(nh, length, hd), torch.randn(nkv, ctx, hd), torch.randn(nkv, ctx, hd)
    ref = chunk_attention(q, k, v)  # fp32: SDPA
    qpos = torch.arange(ctx - length, ctx)[:, None]
    dense = torch.softmax((q.view(nkv, nh // nkv, length, hd) @ k[:, None].transpose(-1, -2)) * hd**-0.5
                          + torch.where(torch.arange(ctx)[None, :] <= qpos, 0.0, float("-inf")), -1) @ v[:, None]
    torch.testing.assert_close(ref, dense.reshape(nh, length, hd), atol=1e-5, rtol=1e-5)
    low = chunk_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), tile=16)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), ref, atol=3e-2, rtol=3e-2)
