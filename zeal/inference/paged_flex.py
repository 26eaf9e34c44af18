"""A paged attention for accelerators: torch's ``flex_attention`` reading the block table.

The fused kernels of :mod:`zeal.inference.kernels` are CPU-only, and the pure-torch
reference of :mod:`zeal.inference.attention` runs dozens of small ops per layer. Here a
pass's attention is two ``flex_attention`` calls per layer (one over its decodes, one
over its prompt chunks padded to one batch), each with a :class:`BlockMask` built once
per pass from the block tables, on the device, with no host synchronisation:

- the KV cache of a layer ``(num_blocks, n_kv, block_size, hd)`` is seen, without a copy,
  as one key/value head holding ``num_blocks * n_kv * block_size`` positions: tile ``t``
  of ``block_size`` positions is block ``t // n_kv``, head ``t % n_kv``;
- sequence ``b``'s query head ``h`` reads the tiles ``table[b, j] * n_kv + h // g`` for
  its logical blocks ``j`` (those it can see from the query tile: causal skipping), and
  the mask inside a tile keeps the positions up to the query's own (``physical-to-logical``
  map of the sequence, built per pass by a scatter).

The same code runs on CPU (eager ``flex_attention``, tested against SDPA and the
reference attention), on CUDA under ``torch.compile`` (the fused Triton kernel). Select
it with ``ZEAL_ATTENTION_BACKEND=flex`` (default on CUDA with torch >= 2.9; ``torch`` there keeps the
reference path), through :func:`attention_backend`.
"""

from __future__ import annotations

import inspect
import os

import torch

from zeal.inference.attention import AttentionMetadata, write_kv

BACKEND_ENV = "ZEAL_ATTENTION_BACKEND"
Q_TILE = 128  # query rows per tile of the block mask
EAGER_SCORE_BYTES = 1 << 30  # the most score memory the uncompiled (CPU test) path may materialise


def attention_backend(device: torch.device, kv_dtype: torch.dtype, dtype: torch.dtype) -> FlexPagedAttention | None:
    """The batched paged-attention backend for ``device``: flex on CUDA (and wherever
    ``ZEAL_ATTENTION_BACKEND=flex``), None (the CPU kernels or the reference) otherwise."""
    choice = os.environ.get(BACKEND_ENV, "")
    if choice not in ("", "flex", "torch"):
        raise ValueError(f"{BACKEND_ENV} must be 'flex' or 'torch', got {choice!r}")
    want = choice == "flex" or (choice == "" and device.type == "cuda")
    if not want:
        return None
    if kv_dtype != dtype and choice != "flex":
        return None  # a cache in another dtype: the reference path converts it per read
    if not flex_supported():
        if choice != "flex":
            return None  # an older torch: the reference path
        raise ValueError(f"{BACKEND_ENV}=flex needs torch >= 2.9 (flex_attention with forward-only block "
                         f"masks); this is torch {torch.__version__}")
    if kv_dtype != dtype:
        raise ValueError(f"the flex attention backend needs the KV cache in the model's dtype ({dtype}), "
                         f"got {kv_dtype}")
    return FlexPagedAttention(compile_kernel=device.type == "cuda")


def flex_supported() -> bool:
    """Whether this torch has what the backend uses: ``flex_attention`` and forward-only
    block masks (``BlockMask.from_kv_blocks(compute_q_blocks=...)``, torch >= 2.9; before,
    the transposed lists it always builds would span the whole cache for every query tile)."""
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:
        return False
    return "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters


def _flex():
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


def _block_mask(tables: torch.Tensor, ctx: torch.Tensor, qlen: torch.Tensor, q_len_max: int, nh: int,
                cache_shape: torch.Size):
    """The :class:`BlockMask` of a batch of sequences over the flat cache view."""
    from torch.nn.attention.flex_attention import BlockMask

    nb, nkv, bs, _ = cache_shape
    g = nh // nkv
    dev = tables.device
    b, w = tables.shape
    ctx, qlen = ctx.long(), qlen.long()
    nused = (ctx + bs - 1) // bs
    cols = torch.where(torch.arange(w, device=dev)[None, :] < nused[:, None], tables.long(), nb)
    logical = torch.full((b, nb + 1), -1, dtype=torch.long, device=dev)
    logical.scatter_(1, cols, torch.arange(w, device=dev).expand(b, w).contiguous())
    logical = logical[:, :nb].contiguous()
    qstart = ctx - qlen  # absolute position of query 0

    def mask_mod(bi, h, q_idx, kv_idx):
        t = kv_idx // bs
        blk = t // nkv
        j = logical[bi, blk]
        return (j >= 0) & (t % nkv == h // g) & (j * bs + kv_idx % bs <= qstart[bi] + q_idx) & (q_idx < qlen[bi])

    n_qt = -(-q_len_max // Q_TILE)
    qt = torch.arange(n_qt, device=dev)
    last_q = torch.minimum((qt[None, :] + 1) * Q_TILE, qlen[:, None])  # queries of the tile, exclusive end
    num = torch.where(qt[None, :] * Q_TILE < qlen[:, None], (qstart[:, None] + last_q + bs - 1) // bs, 0)
    num = num.clamp(max=w)[:, None, :].expand(b, nh, n_qt).to(torch.int32).contiguous()  # (B, H, QT)
    head = (torch.arange(nh, device=dev) // g)[None, :, None, None]
    idx = (tables.long()[:, None, None, :] * nkv + head).expand(b, nh, n_qt, w).to(torch.int32).contiguous()
    # the list of tiles per query tile is only as wide as the longest table (forward only:
    # no transposed q-block lists, whose dense build would span the whole cache)
    return BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=(Q_TILE, bs), mask_mod=mask_mod,
                                    seq_lengths=(q_len_max, nb * nkv * bs), compute_q_blocks=False)


class FlexPagedAttention:
    """The :class:`AttentionMetadata` ``backend`` of a pass (see the module docstring):
    :meth:`attend` writes the new K/V into the cache, then attends through the block
    tables of ``meta.decodes`` (:class:`DecodeTables`) and ``meta.prefill_batch``."""

    def __init__(self, compile_kernel: bool = False) -> None:
        self.compile_kernel = compile_kernel
        self._kernel = None

    @property
    def flex(self):
        if self._kernel is None:
            fn = _flex()
            self._kernel = torch.compile(fn, dynamic=True) if self.compile_kernel else fn
        return self._kernel

    def _masks(self, meta: AttentionMetadata, nh: int, cache_shape: torch.Size) -> dict:
        """The pass's block masks, built by its first layer and shared by the others."""
        cached = getattr(meta, "_flex_masks", None)
        if cached is not None:
            return cached
        masks = {}
        dec = meta.decodes
        if dec is not None and dec.num_decodes:
            ones = torch.ones_like(dec.ctx_lens)
            masks["dec"] = _block_mask(dec.block_tables, dec.ctx_lens, ones, 1, nh, cache_shape)
        pb = meta.prefill_batch
        if pb is not None:
            masks["pre"] = _block_mask(pb.tables, pb.ctx_lens, pb.q_lens, pb.max_q_len, nh, cache_shape)
        meta._flex_masks = masks
        return masks

    def _run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask) -> torch.Tensor:
        """``q (B, nh, L, hd)`` over the flat cache view (one K/V head, broadcast over B)."""
        b = q.shape[0]
        if not self.compile_kernel:  # eager: the scores of every query over the whole cache are materialised
            need = b * q.shape[1] * q.shape[2] * k_cache.numel() // k_cache.shape[-1] * 4
            if need > EAGER_SCORE_BYTES:
                raise ValueError(f"the eager flex attention (a CPU test path) would materialise {need / 2**30:.1f} GiB "
                                 "of scores over the whole KV cache: give a smaller num_blocks, or unset "
                                 f"{BACKEND_ENV}")
        flat = (1, 1, -1, k_cache.shape[-1])
        kf = k_cache.view(flat).expand(b, -1, -1, -1)
        vf = v_cache.view(flat).expand(b, -1, -1, -1)
        opts = None
        if self.compile_kernel:  # the fused kernel walks one cache block (a sparse KV tile) per inner step
            opts = {"BLOCK_N": min(k_cache.shape[2], 64)}
        return self.flex(q, kf, vf, block_mask=mask, enable_gqa=True, kernel_options=opts)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: (T, nh, hd); k, v: (T, nkv, hd) of the pass; returns (T, nh, hd)."""
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        t, nh, hd = q.shape
        masks = self._masks(meta, nh, k_cache.shape)
        out = torch.zeros(t + 1, nh, hd, dtype=q.dtype, device=q.device)  # row t: the padding's sink
        dec = meta.decodes
        if "dec" in masks:
            y = self._run(q[dec.rows][:, :, None], k_cache, v_cache, masks["dec"])  # (D, nh, 1, hd)
            out[dec.rows] = y[:, :, 0]
        pb = meta.prefill_batch
        if "pre" in masks:
            qx = torch.cat([q, q.new_zeros(1, nh, hd)])
            qp = qx.index_select(0, pb.gather).view(-1, pb.max_q_len, nh, hd).transpose(1, 2)
            y = self._run(qp, k_cache, v_cache, masks["pre"])  # (P, nh, L, hd)
            out.index_copy_(0, pb.gather, y.transpose(1, 2).reshape(-1, nh, hd))
        return out[:t]
