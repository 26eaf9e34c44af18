"""Paged attention equals dense causal attention, for decode tokens and prompt chunks."""

from __future__ import annotations

import pytest
import torch

from zeal.inference.attention import (
    AttentionMetadata,
    DecodeGroup,
    PrefillChunk,
    group_by_width,
    paged_attention,
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
    kc = torch.zeros(nblocks, bs, nkv, hd)
    vc = torch.zeros(nblocks, bs, nkv, hd)

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
    width = max(len(t) for _, t, _ in dec)
    meta2.decode_rows = torch.tensor([r for r, _, _ in dec])
    meta2.decode_block_tables = torch.tensor([t + [0] * (width - len(t)) for _, t, _ in dec])
    meta2.decode_ctx_lens = torch.tensor([n for _, _, n in dec])
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


def test_group_by_width_partitions_and_prices_groups():
    widths = [1, 30, 2, 29, 3, 31, 1, 28]
    groups = group_by_width(widths, group_cost=4)
    assert sorted(sum(groups, [])) == list(range(len(widths)))
    assert [sorted(widths[i] for i in g) for g in groups] == [[1, 1, 2, 3], [28, 29, 30, 31]]
    assert group_by_width([5] * 6) == [list(range(6))]  # equal widths: one group
    assert group_by_width([]) == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize("nh,nkv", [(4, 2), (6, 1)])
def test_grouped_decodes_equal_dense(nh, nkv):
    """Decode tokens of very different context lengths, attended in several width groups."""
    torch.manual_seed(1)
    hd, bs, nblocks = 8, 4, 128
    lens = [2, 3, 9, 17, 30, 41, 5, 60]  # tokens per sequence; the last one is this pass's decode token
    perm = torch.randperm(nblocks).tolist()
    tables, used = [], 0
    for n in lens:
        k = -(-n // bs)
        tables.append(perm[used : used + k])
        used += k
    kc, vc = torch.zeros(nblocks, bs, nkv, hd), torch.zeros(nblocks, bs, nkv, hd)
    qs = [torch.randn(n, nh, hd) for n in lens]
    ks = [torch.randn(n, nkv, hd) for n in lens]
    vs = [torch.randn(n, nkv, hd) for n in lens]
    for i, n in enumerate(lens):  # the cached prefix of every sequence
        for p in range(n - 1):
            kc[tables[i][p // bs], p % bs], vc[tables[i][p // bs], p % bs] = ks[i][p], vs[i][p]
    q = torch.stack([x[-1] for x in qs])
    k = torch.stack([x[-1] for x in ks])
    v = torch.stack([x[-1] for x in vs])
    slots = torch.tensor([tables[i][(n - 1) // bs] * bs + (n - 1) % bs for i, n in enumerate(lens)])
    groups = group_by_width([len(t) for t in tables], group_cost=0)
    assert len(groups) > 2
    meta = AttentionMetadata(slots)
    for g in groups:
        w = max(len(tables[i]) for i in g)
        meta.decode_groups.append(DecodeGroup(torch.tensor(g), torch.tensor([tables[i] + [0] * (w - len(tables[i]))
                                                                             for i in g]),
                                              torch.tensor([lens[i] for i in g])))
    out = paged_attention(q, k, v, kc.clone(), vc.clone(), meta)
    for i in range(len(lens)):
        torch.testing.assert_close(out[i], dense_causal_attention(qs[i], ks[i], vs[i])[-1])
