"""Paged attention in pure torch: K/V live in blocks, gathered through block tables.

Cache layout per layer: ``k_cache, v_cache`` of shape
``(num_blocks, block_size, n_kv_heads, head_dim)``. Token ``p`` of a sequence
lives in slot ``p % block_size`` of block ``block_table[p // block_size]``.

A ragged pass mixes decode tokens (one query per sequence) and prompt chunks.
Decodes are batched into one masked attention over the padded gathered
contexts; each prompt chunk attends on its own (causal, offset by the tokens
already in cache). On CUDA ``F.scaled_dot_product_attention`` picks a fused
kernel; on CPU it is the math path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """Rows ``[q_start, q_start + q_len)`` of the flat batch; the sequence then has
    ``ctx_len`` tokens in cache (the chunk included)."""

    q_start: int
    q_len: int
    ctx_len: int
    block_table: torch.Tensor  # (num_blocks_of_seq,)


@dataclass
class DecodeGroup:
    """Decode tokens attended together: their contexts are padded to the group's widest."""

    rows: torch.Tensor  # (D,) rows of decode tokens in the flat batch
    block_tables: torch.Tensor  # (D, max_blocks), padded with 0
    ctx_lens: torch.Tensor  # (D,)


@dataclass
class AttentionMetadata:
    """How the flat batch maps onto the paged cache for one pass.

    Decodes come either as one group (``decode_rows``, ``decode_block_tables``,
    ``decode_ctx_lens``) or as several ``decode_groups`` of similar context
    lengths, so that short contexts are not padded to the longest one.
    """

    slot_mapping: torch.Tensor  # (T,) flat slot index of each new token
    decode_rows: torch.Tensor | None = None  # (D,) rows of decode tokens in the flat batch
    decode_block_tables: torch.Tensor | None = None  # (D, max_blocks), padded with 0
    decode_ctx_lens: torch.Tensor | None = None  # (D,)
    prefills: list[PrefillChunk] = field(default_factory=list)
    decode_groups: list[DecodeGroup] = field(default_factory=list)

    def all_decode_groups(self) -> list[DecodeGroup]:
        groups = list(self.decode_groups)
        if self.decode_rows is not None and self.decode_rows.numel():
            groups.append(DecodeGroup(self.decode_rows, self.decode_block_tables, self.decode_ctx_lens))
        return groups


def group_by_width(widths: list[int], group_cost: int = 32) -> list[list[int]]:
    """Partition decode indices into groups of similar context width (in blocks).

    Minimises ``sum(len(group) * max_width(group)) + group_cost * num_groups``
    (padded blocks gathered, plus a fixed price per group for its extra kernel
    launches) over contiguous runs of the indices sorted by width; O(D^2).
    """
    order = sorted(range(len(widths)), key=lambda i: widths[i])
    n = len(order)
    if n <= 2:
        return [order] if order else []
    best = [0] + [0] * n  # best[j]: cost of the j narrowest
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        w = widths[order[j - 1]]  # the widest of any group ending at j
        best[j], cut[j] = min((best[i] + (j - i) * w + group_cost, i) for i in range(j))
    groups, j = [], n
    while j:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store new keys/values ``(T, n_kv, hd)`` at their slots."""
    nb, bs, nkv, hd = k_cache.shape
    k_cache.view(nb * bs, nkv, hd).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(nb * bs, nkv, hd).index_copy_(0, slots, v.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, ctx_len: int) -> torch.Tensor:
    """Contiguous ``(ctx_len, n_kv, hd)`` view of one sequence's cached keys or values."""
    bs = cache.shape[1]
    if ctx_len <= bs:
        return cache[block_table[0], :ctx_len]
    return cache.index_select(0, block_table).reshape(-1, *cache.shape[2:])[:ctx_len]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Write this pass's K/V into the cache, then attend. q: (T, nh, hd); k, v: (T, nkv, hd)."""
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    nh, nkv = q.shape[1], k.shape[1]
    gqa = nh != nkv
    for g in meta.all_decode_groups():
        tables, lens = g.block_tables, g.ctx_lens
        d, mb = tables.shape
        bs = k_cache.shape[1]
        # index_select copies whole blocks: about 2x faster than advanced indexing on CPU
        flat = tables.reshape(-1)
        kd = k_cache.index_select(0, flat).view(d, mb * bs, nkv, -1).transpose(1, 2)  # (D, nkv, L, hd)
        vd = v_cache.index_select(0, flat).view(d, mb * bs, nkv, -1).transpose(1, 2)
        mask = torch.arange(mb * bs, device=q.device)[None, :] < lens[:, None]  # (D, L)
        qd = q[g.rows].unsqueeze(2)  # (D, nh, 1, hd)
        y = F.scaled_dot_product_attention(qd, kd.to(q.dtype), vd.to(q.dtype), attn_mask=mask[:, None, None, :],
                                           enable_gqa=gqa)
        out[g.rows] = y.squeeze(2)
    for c in meta.prefills:
        rows = slice(c.q_start, c.q_start + c.q_len)
        # 4-D (1, heads, len, hd): the fused kernels want a batch dimension
        qc = q[rows].transpose(0, 1)[None]
        if c.ctx_len == c.q_len:  # nothing cached before this chunk: use the fresh K/V
            kc, vc = k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None]
            y = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=gqa)
        else:
            kc = gather_kv(k_cache, c.block_table, c.ctx_len).transpose(0, 1)[None].to(q.dtype)
            vc = gather_kv(v_cache, c.block_table, c.ctx_len).transpose(0, 1)[None].to(q.dtype)
            # query i sits at absolute position ctx_len - q_len + i and sees keys <= it
            qpos = torch.arange(c.ctx_len - c.q_len, c.ctx_len, device=q.device)[:, None]
            mask = torch.arange(c.ctx_len, device=q.device)[None, :] <= qpos
            y = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, enable_gqa=gqa)
        out[rows] = y[0].transpose(0, 1)
    return out
