"""The flex_attention paged attention (the CUDA path) against SDPA over the gathered
context, on CPU: prefill, chunked prefill, prefix hits and ragged decodes in one pass;
its block mask lists every cache tile a query attends to (what the fused kernel reads)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from zeal.inference.attention import gather_kv
from zeal.inference.model_runner import StepPlan
from zeal.inference.paged_flex import FlexPagedAttention, _block_mask
from zeal.inference.step_inputs import StepInputPacker

NB, NKV, NH, BS, HD = 40, 2, 6, 4, 8


def _scenario(seed: int):
    """A pass: (q_len, ctx_len, table) per sequence; decodes first, then prompt chunks."""
    rng = random.Random(seed)
    free = list(range(NB))
    rng.shuffle(free)
    seqs = []
    for q_len, ctx in [(1, 1), (1, 9), (1, 13), (1, 4), (7, 7), (5, 17), (3, 3), (6, 10)]:
        n = -(-ctx // BS)
        table = [free.pop() for _ in range(n)] + [free.pop() for _ in range(rng.randrange(2))]  # spare blocks
        seqs.append((q_len, ctx, table))
    return seqs


def _plan(seqs) -> StepPlan:
    p = StepPlan()
    for q_len, ctx, table in seqs:
        row0 = len(p.ids)
        start = ctx - q_len
        p.ids += [0] * q_len
        p.pos += list(range(start, ctx))
        p.slots += [table[q // BS] * BS + q % BS for q in range(start, ctx)]
        p.sample_rows.append(row0 + q_len - 1)
        if q_len == 1 and start > 0:
            p.dec_rows.append(row0)
            p.dec_tables.append(table)
            p.dec_lens.append(ctx)
        else:
            p.prefills.append([row0, q_len, ctx, table])
    return p


def _reference(q, k_cache, v_cache, seqs):
    out, row = [], 0
    for q_len, ctx, table in seqs:
        t = torch.tensor(table, dtype=torch.int32)
        kc, vc = gather_kv(k_cache, t, ctx), gather_kv(v_cache, t, ctx)  # (nkv, ctx, hd)
        qs = q[row : row + q_len].transpose(0, 1)[None]  # (1, nh, L, hd)
        qpos = torch.arange(ctx - q_len, ctx)[:, None]
        mask = torch.arange(ctx)[None, :] <= qpos
        y = F.scaled_dot_product_attention(qs, kc[None], vc[None], attn_mask=mask, enable_gqa=True)
        out.append(y[0].transpose(0, 1))
        row += q_len
    return torch.cat(out)


@pytest.mark.parametrize("seed", [0, 1])
def test_flex_paged_attention_matches_sdpa(seed):
    torch.manual_seed(seed)
    seqs = _scenario(seed)
    plan = _plan(seqs)
    t = len(plan.ids)
    k_cache, v_cache = torch.randn(NB, NKV, BS, HD), torch.randn(NB, NKV, BS, HD)
    q, k, v = torch.randn(t, NH, HD), torch.randn(t, NKV, HD), torch.randn(t, NKV, HD)
    backend = FlexPagedAttention()
    _, _, meta, _ = StepInputPacker(torch.device("cpu"), BS).prepare(plan, backend=backend)
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    out = backend.attend(q, k, v, kc2, vc2, meta)
    # the reference reads the cache the pass wrote (new K/V at their slots)
    slots = torch.tensor(plan.slots)
    k_cache[slots // BS, :, slots % BS] = k
    v_cache[slots // BS, :, slots % BS] = v
    assert torch.equal(kc2, k_cache) and torch.equal(vc2, v_cache)
    ref = _reference(q, k_cache, v_cache, seqs)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_block_mask_lists_every_tile_a_query_reads():
    """The fused kernel visits only the listed tiles: each (query, key) the mask keeps must
    lie in one, and a sequence's tiles come from its own table only."""
    from torch.nn.attention.flex_attention import create_mask

    seqs = _scenario(3)[4:]
    w = max(len(tb) for _, _, tb in seqs)
    tables = torch.tensor([tb + [0] * (w - len(tb)) for _, _, tb in seqs], dtype=torch.int32)
    ctx = torch.tensor([c for _, c, _ in seqs], dtype=torch.int32)
    qlen = torch.tensor([n for n, _, _ in seqs], dtype=torch.int32)
    lmax = int(qlen.max())
    bm = _block_mask(tables, ctx, qlen, lmax, NH, torch.Size((NB, NKV, BS, HD)))
    dense = create_mask(bm.mask_mod, len(seqs), NH, lmax, NB * NKV * BS, device="cpu")  # (B, H, L, KV)
    tiles = torch.zeros(len(seqs), NH, 1, NB * NKV, dtype=torch.bool)  # (B, H, QT, KV tiles) listed
    for b in range(len(seqs)):
        for h in range(NH):
            n = int(bm.kv_num_blocks[b, h, 0])
            tiles[b, h, 0, bm.kv_indices[b, h, 0, :n].long()] = True
    need = dense.view(len(seqs), NH, -1, lmax, NB * NKV, BS).any(-1).any(-2) if lmax <= 128 else None
    assert need is not None and (need.sum() > 0)
    assert not (need & ~tiles).any()
    # every query sees exactly its context up to itself
    for b, (q_len, c, _) in enumerate(seqs):
        for i in range(q_len):
            assert int(dense[b, 0, i].sum()) == c - q_len + i + 1


def test_a_torch_without_forward_only_block_masks_keeps_the_reference_path(monkeypatch):
    """torch 2.5-2.8's ``BlockMask.from_kv_blocks`` has no ``compute_q_blocks`` (its transposed
    lists would span the whole cache): CUDA's default falls back to the reference path, an
    explicit ``flex`` is refused in one line, and nothing reaches the older call."""
    from torch.nn.attention.flex_attention import BlockMask

    from zeal.inference.paged_flex import BACKEND_ENV, attention_backend

    def older(cls, kv_num_blocks, kv_indices, full_kv_num_blocks=None, full_kv_indices=None,
              BLOCK_SIZE=128, mask_mod=None, seq_lengths=None):  # noqa: N803 - torch's spelling
        raise AssertionError("the backend must not be used on this torch")

    cuda, f32 = torch.device("cuda"), torch.float32
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert isinstance(attention_backend(cuda, f32, f32), FlexPagedAttention)
    monkeypatch.setattr(BlockMask, "from_kv_blocks", classmethod(older))
    assert attention_backend(cuda, f32, f32) is None
    monkeypatch.setenv(BACKEND_ENV, "flex")
    with pytest.raises(ValueError, match="needs torch >= 2.9"):
        attention_backend(torch.device("cpu"), f32, f32)
