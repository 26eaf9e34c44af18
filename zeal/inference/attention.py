"""Paged attention: K/V live in blocks, addressed through block tables.

Cache layout per layer: ``k_cache, v_cache`` of shape
``(num_blocks, n_kv_heads, block_size, head_dim)``. Token ``p`` of a sequence
lives in slot ``p % block_size`` of block ``block_table[p // block_size]``; one
block of one head is a contiguous ``(block_size, head_dim)`` matrix.

A ragged pass mixes decode tokens (one query per sequence) and prompt chunks.

Decodes are attended block by block, split-K style (flash-decoding): every
(sequence, block) pair gives a partial softmax — its maximum score, its sum of
exponentials and its weighted sum of values — and the partials of one sequence
are merged by rescaling to their common maximum. Blocks are read where they lie:
:func:`plan_decodes` turns the block tables into runs of consecutive block ids
(the block manager hands out low ids first, so the blocks in use are packed),
each a plain slice of the cache, and only blocks outside any run (or shared by
a second sequence) are gathered. Grouped-query heads ride along as extra query
rows of their K/V head, so K/V are never repeated per head.

Each prompt chunk attends on its own (causal, offset by the tokens already in
cache), see :func:`chunk_attention`.

On CPU, when the fused kernels of :mod:`zeal.inference.kernels` are built, the
model runner hands :func:`paged_attention` :class:`DecodeTables` instead of a
plan and the same work runs in C++: decodes read every block through their block
table, prompt chunks attend over their blocks with an online softmax, and the
new K/V are written by a kernel too. The pure-torch code here is the reference
those kernels are tested against, and the path everywhere else.
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
    block_table: torch.Tensor  # (num_blocks_of_seq,) int32


@dataclass
class BlockSegment:
    """Cache blocks attended together: the slice ``[start, stop)`` of the cache, or the
    gathered ``blocks``. Block ``i`` of the segment belongs to decode ``owner[i]`` (an
    index into the pass's decodes; the number of decodes for a block nobody in this
    pass reads); ``mask`` marks the slots past a sequence's last token (None when every
    block of the segment is full)."""

    owner: torch.Tensor  # (n,) long
    mask: torch.Tensor | None  # (n, block_size) bool, True = no token there
    start: int = 0
    stop: int = 0
    blocks: torch.Tensor | None = None  # (n,) long: gathered instead of sliced


@dataclass
class DecodePlan:
    """How the decode tokens of one pass read the cache: ``rows`` of the flat batch,
    attended over ``segments`` whose per-block partials are merged by owner."""

    rows: torch.Tensor  # (D,)
    segments: list[BlockSegment]
    owner: torch.Tensor  # (sum of segment lengths,): the segments' owners, concatenated

    @property
    def num_decodes(self) -> int:
        return self.rows.numel()


@dataclass
class DecodeTables:
    """The decode tokens of one pass for the fused CPU kernel, which reads every block
    where it lies through the sequence's block table: ``rows`` of the flat batch (a
    slice when they are consecutive, as the scheduler puts decodes first)."""

    rows: slice | torch.Tensor
    block_tables: torch.Tensor  # (D, max blocks) int32, padded with 0
    ctx_lens: torch.Tensor  # (D,) int32: tokens in cache, the new one included

    @property
    def num_decodes(self) -> int:
        return self.ctx_lens.numel()


def decode_tables(rows: list[int], tables: list[list[int]], ctx_lens: list[int], block_size: int,
                  device: torch.device | str = "cpu") -> DecodeTables:
    """:class:`DecodeTables` for decode ``i`` at row ``rows[i]`` with ``ctx_lens[i]`` tokens
    in the blocks ``tables[i]`` (only the blocks holding them are kept)."""
    used = [t[: -(-n // block_size)] for t, n in zip(tables, ctx_lens)]
    width = max(map(len, used))
    padded = [t + [0] * (width - len(t)) for t in used]
    r: slice | torch.Tensor
    if rows == list(range(rows[0], rows[0] + len(rows))):
        r = slice(rows[0], rows[0] + len(rows))
    else:
        r = torch.tensor(rows, dtype=torch.long, device=device)
    return DecodeTables(r, torch.tensor(padded, dtype=torch.int32, device=device),
                        torch.tensor(ctx_lens, dtype=torch.int32, device=device))


@dataclass
class AttentionMetadata:
    """How the flat batch maps onto the paged cache for one pass. ``kernels``: the fused
    CPU ops (:func:`zeal.inference.kernels.cpu_kernels`) when decodes are DecodeTables."""

    slot_mapping: torch.Tensor  # (T,) flat slot index of each new token
    prefills: list[PrefillChunk] = field(default_factory=list)
    decodes: DecodePlan | DecodeTables | None = None
    kernels: object | None = None
    # a batched paged-attention backend (zeal.inference.paged_flex) that attends instead of the code
    # below, and the padded prompt chunks it reads (zeal.inference.step_inputs.PrefillBatch)
    backend: object | None = None
    prefill_batch: object | None = None


def plan_decodes(rows: list[int], tables: list[list[int]], ctx_lens: list[int], block_size: int,
                 device: torch.device | str = "cpu", max_gap: int = 32, min_run: int = 8) -> DecodePlan:
    """Segments for decode ``i`` (row ``rows[i]``, blocks ``tables[i]``, ``ctx_lens[i]``
    tokens in cache, its new one included).

    Each block read by some decode is sliced in place when it lies in a run of
    at least ``min_run`` such blocks whose holes are at most ``max_gap`` blocks
    wide (a hole costs reading blocks nobody needs; a segment costs a dozen
    kernel launches per layer); the rest — scattered blocks, and blocks that a
    second decode shares (prefix caching, ``n > 1``) — are gathered into one
    segment.
    """
    num = len(rows)
    owned: dict[int, tuple[int, int]] = {}  # block -> (decode, tokens in it)
    extra: list[tuple[int, int, int]] = []  # (block, decode, tokens) for a second reader
    for d, (table, n) in enumerate(zip(tables, ctx_lens)):
        for j, b in enumerate(table[: -(-n // block_size)]):
            item = (d, min(block_size, n - j * block_size))
            if b in owned:
                extra.append((b, *item))
            else:
                owned[b] = item
    runs: list[list[int]] = []
    for b in sorted(owned):
        if runs and b - runs[-1][-1] - 1 <= max_gap:
            runs[-1].append(b)
        else:
            runs.append([b])
    segments: list[BlockSegment] = []
    owners: list[torch.Tensor] = []

    def add(owner: list[int], valid: list[int], **where) -> None:
        o = torch.tensor(owner, dtype=torch.long, device=device)
        v = torch.tensor(valid, device=device)
        mask = None
        if min(valid) < block_size:
            mask = torch.arange(block_size, device=device)[None, :] >= v[:, None]
        segments.append(BlockSegment(owner=o, mask=mask, **where))
        owners.append(o)

    for run in runs:
        if len(run) < min_run:
            extra.extend((b, *owned[b]) for b in run)
            continue
        start, stop = run[0], run[-1] + 1
        owner, valid = [num] * (stop - start), [block_size] * (stop - start)  # holes: a zero query
        for b in run:
            owner[b - start], valid[b - start] = owned[b]
        add(owner, valid, start=start, stop=stop)
    if extra:
        add([d for _, d, _ in extra], [n for _, _, n in extra],
            blocks=torch.tensor([b for b, _, _ in extra], dtype=torch.long, device=device))
    owner = torch.cat(owners) if owners else torch.empty(0, dtype=torch.long, device=device)
    return DecodePlan(rows=torch.tensor(rows, dtype=torch.long, device=device), segments=segments, owner=owner)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store new keys/values ``(T, n_kv, hd)`` at their slots."""
    bs = k_cache.shape[2]
    blk, off = slots // bs, slots % bs
    k_cache[blk, :, off] = k.to(k_cache.dtype)
    v_cache[blk, :, off] = v.to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, ctx_len: int) -> torch.Tensor:
    """``(n_kv, ctx_len, hd)``: one sequence's cached keys or values, contiguous per head."""
    nkv, bs, hd = cache.shape[1:]
    if ctx_len <= bs:
        return cache[block_table[0], :, :ctx_len]
    blocks = cache.index_select(0, block_table[: -(-ctx_len // bs)])  # (nb, nkv, bs, hd)
    return blocks.transpose(0, 1).reshape(nkv, -1, hd)[:, :ctx_len]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan) -> torch.Tensor:
    """Attention of one query per decode ``(D, nh, hd)`` over its cached context."""
    d, nh, hd = q.shape
    nkv = k_cache.shape[1]
    g = nh // nkv
    # query heads of one K/V head are rows of one small matrix; row d is a zero query for holes
    qx = torch.zeros(d + 1, nkv, g, hd, dtype=q.dtype, device=q.device)
    qx[:d] = q.view(d, nkv, g, hd) * hd**-0.5
    maxes, sums, outs = [], [], []
    for seg in plan.segments:
        if seg.blocks is None:
            kb, vb = k_cache[seg.start : seg.stop], v_cache[seg.start : seg.stop]
        else:
            kb, vb = k_cache.index_select(0, seg.blocks), v_cache.index_select(0, seg.blocks)
        # scores (n, nkv, g, bs); the softmax arithmetic in fp32
        s = torch.matmul(qx.index_select(0, seg.owner), kb.transpose(-1, -2).to(q.dtype)).float()
        if seg.mask is not None:
            s.masked_fill_(seg.mask[:, None, None, :], float("-inf"))
        m = s.amax(-1, keepdim=True)
        e = s.sub_(m).exp_()
        sums.append(e.sum(-1, keepdim=True))
        outs.append(torch.matmul(e.to(q.dtype), vb.to(q.dtype)))
        maxes.append(m)
    # usually one segment: its tensors are used as they are, not copied by cat
    m, s, o = (xs[0] if len(xs) == 1 else torch.cat(xs) for xs in (maxes, sums, outs))
    idx = plan.owner.view(-1, 1, 1, 1)
    top = torch.full((d + 1, nkv, g, 1), float("-inf"), device=q.device)
    top.scatter_reduce_(0, idx.expand_as(m), m, "amax")
    w = torch.exp(m - top.index_select(0, plan.owner))
    # o * w promotes a bf16/fp16 o to fp32 in the same pass
    num = torch.zeros(d + 1, nkv, g, hd, device=q.device).index_add_(0, plan.owner, o * w)
    den = torch.zeros(d + 1, nkv, g, 1, device=q.device).index_add_(0, plan.owner, s * w)
    return (num[:d] / den[:d]).to(q.dtype).view(d, nh, hd)


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tile: int = 128) -> torch.Tensor:
    """Causal attention of a prompt chunk ``q (nh, L, hd)`` over its sequence's keys and
    values ``(nkv, C, hd)``, the chunk being the last ``L`` of the ``C`` positions.

    On CPU in bf16/fp16, grouped matmuls over tiles of ``tile`` queries (each tile
    reads only the keys it can see) run 1.6-2x faster than the fused SDPA kernel;
    scores and probabilities are rounded to the model's dtype as in Hugging Face's
    eager attention (the softmax itself accumulates in fp32). Elsewhere:
    ``F.scaled_dot_product_attention``.
    """
    nh, length, hd = q.shape
    nkv, ctx = k.shape[0], k.shape[1]
    if q.device.type != "cpu" or q.dtype not in (torch.bfloat16, torch.float16):
        if ctx == length:
            y = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=nh != nkv)
        else:  # query i sits at absolute position ctx - length + i and sees keys <= it
            qpos = torch.arange(ctx - length, ctx, device=q.device)[:, None]
            mask = torch.arange(ctx, device=q.device)[None, :] <= qpos
            y = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, enable_gqa=nh != nkv)
        return y[0]
    g, off = nh // nkv, ctx - length
    k, v = k.contiguous(), v.contiguous()
    qg = (q * hd**-0.5).view(nkv, g, length, hd)
    out = torch.empty_like(q)
    for a in range(0, length, tile):
        b = min(length, a + tile)
        seen = off + b  # keys visible to the tile's last query
        s = torch.matmul(qg[:, :, a:b].reshape(nkv, g * (b - a), hd), k[:, :seen].transpose(-1, -2))
        s = s.view(nkv, g, b - a, seen)
        # only keys within the tile's own span can lie ahead of one of its queries
        ahead = torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).triu_(1)
        s[..., off + a :].masked_fill_(ahead, float("-inf"))
        p = torch.softmax(s, -1).view(nkv, g * (b - a), seen)  # fp32 inside, rounded once
        out[:, a:b] = torch.matmul(p, v[:, :seen]).view(nh, b - a, hd)
    return out


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Write this pass's K/V into the cache, then attend. q: (T, nh, hd); k, v: (T, nkv, hd)."""
    if meta.backend is not None:
        return meta.backend.attend(q, k, v, k_cache, v_cache, meta)
    ops = meta.kernels
    scale = q.shape[-1] ** -0.5
    if ops is not None:  # the runner uses kernels only with the cache in the model's dtype
        ops.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    else:
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    plan = meta.decodes
    if isinstance(plan, DecodeTables):
        if isinstance(plan.rows, slice):  # the kernel writes its rows of out in place
            ops.decode_attention(q[plan.rows].contiguous(), k_cache, v_cache, plan.block_tables,
                                 plan.ctx_lens, scale, out[plan.rows])
        else:
            o = torch.empty(plan.num_decodes, *q.shape[1:], dtype=q.dtype, device=q.device)
            ops.decode_attention(q.index_select(0, plan.rows), k_cache, v_cache, plan.block_tables,
                                 plan.ctx_lens, scale, o)
            out[plan.rows] = o
    elif plan is not None and plan.num_decodes:
        out[plan.rows] = decode_attention(q.index_select(0, plan.rows), k_cache, v_cache, plan)
    for c in meta.prefills:
        rows = slice(c.q_start, c.q_start + c.q_len)
        if ops is not None:  # reads the chunk's context (itself included) from the cache
            ops.chunk_attention(q[rows], k_cache, v_cache, c.block_table, c.ctx_len, scale, out[rows])
            continue
        if c.ctx_len == c.q_len:  # nothing cached before this chunk: use the fresh K/V
            kc, vc = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
        else:
            kc, vc = gather_kv(k_cache, c.block_table, c.ctx_len), gather_kv(v_cache, c.block_table, c.ctx_len)
        out[rows] = chunk_attention(q[rows].transpose(0, 1), kc.to(q.dtype), vc.to(q.dtype)).transpose(0, 1)
    return out


class PagedAttention:
    """The attention object of one serving pass (see :mod:`zeal.models.attention`): layer
    ``i`` writes its new K/V into ``k_caches[i]``/``v_caches[i]`` and attends through the
    block tables of ``meta``. ``ops``: the fused CPU kernels the layers use in this pass
    (``meta.kernels``; None: torch ops)."""

    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], meta: AttentionMetadata) -> None:
        self.k_caches, self.v_caches, self.meta = k_caches, v_caches, meta
        self.ops = meta.kernels

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 dropout_p: float = 0.0) -> torch.Tensor:
        # q (T, nh, hd), k/v (T, nkv, hd): a flat batch; serving never drops out
        return paged_attention(q, k, v, self.k_caches[layer_idx], self.v_caches[layer_idx], self.meta)
