"""Block quantization and the quantized collectives of ZeRO++ (qwZ, qgZ).

The quantizer (algorithms.md §4.2, clean-room variant) is symmetric and per block:
a flat tensor is cut into blocks of ``block_size`` elements (the last block may be
ragged; it is padded with zeros internally, which leaves its absmax unchanged). For a
block with absmax ``a`` and ``qmax = 2**(bits-1) - 1`` (127 for int8, 7 for int4):

    step  = a / qmax              (= 1/s with s = qmax/a; stored per block as fp32)
    q     = round_half_even(x / step)    in [-qmax, qmax]; step := 1 when a == 0
    x_hat = q * step

Error bound. In exact arithmetic ``|x - x_hat| <= step/2 = a / (2*qmax)`` for every
element (no clamping ever happens since |x| <= a). In fp32 (unit roundoff u = 2^-24)
the three roundings (step, x/step, q*step) add at most ``3*u*a``, and a block whose
step underflows to a subnormal (a < qmax * 2^-126) may additionally lose up to
2^-118 in absolute terms. :func:`error_bound` returns

    a / (2*qmax) + 3 * 2^-24 * a + 2^-118

which holds for every finite fp32 input (tests check it with hypothesis). Values on
the block's grid round-trip exactly: if ``x = k*step`` with integer ``|k| <= qmax``,
the block's absmax is ``qmax*step`` and each product is exact in fp32, then
``x_hat == x`` (division is correctly rounded, so ``(k*step)/step == k``).

Int8 codes are stored as int8; int4 codes as two's-complement nibbles packed two per
uint8, the first element of each pair in the high nibble. Inputs of any float dtype
are quantized from their fp32 value; NaN/inf inputs give unspecified output.

Collectives (explicit process groups, ``None`` = running alone):
* :func:`quantized_all_gather` (qwZ): each rank sends ``quantized_nbytes(shard)``.
* :func:`quantized_reduce_scatter` (qgZ): two all-to-alls, inside the node then
  across nodes, each quantizing once; returns the reduce-scatter *mean*.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from zeal.dist.comm import all_gather_flat

_QMAX = {8: 127, 4: 7}
_U = 2.0**-24
_FMAX = torch.finfo(torch.float32).max

# record(op, group_size, nbytes_sent_by_this_rank): optional byte-accounting hook.
Recorder = Callable[[str, int, int], None]


def _check_bits(bits: int) -> int:
    if bits not in _QMAX:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    return _QMAX[bits]


def _num_blocks(numel: int, block_size: int) -> int:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return -(-numel // block_size)


def _payload_len(numel: int, bits: int) -> int:
    return numel if bits == 8 else (numel + 1) // 2


def quantized_nbytes(numel: int, bits: int, block_size: int) -> int:
    """Bytes of a quantized tensor of ``numel`` elements: packed codes + one fp32 per block."""
    _check_bits(bits)
    return _payload_len(numel, bits) + 4 * _num_blocks(numel, block_size)


def error_bound(absmax: torch.Tensor | float, bits: int) -> torch.Tensor | float:
    """Largest ``|x - dequantize(quantize(x))|`` for an element of a block with this absmax."""
    qmax = _check_bits(bits)
    return absmax / (2 * qmax) + 3 * _U * absmax + 2.0**-118


@dataclass(frozen=True)
class QuantizedTensor:
    """Block-quantized tensor: ``data`` holds the codes (int8, or uint8 with two int4
    codes per byte), ``scales`` the fp32 step (absmax/qmax) of each block."""

    data: torch.Tensor
    scales: torch.Tensor
    numel: int
    shape: tuple[int, ...]
    bits: int
    block_size: int

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel() * 4


# -- row-batched kernels: every row of a (R, L) tensor is quantized independently ---------


def _pad_cols(x: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad the columns of a 2-D tensor to ``width`` (no copy when already that wide)."""
    return x if x.shape[1] == width else F.pad(x, (0, width - x.shape[1]))


def quantize_rows(x: torch.Tensor, bits: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of ``x`` (R, L) on its own block grid.

    Returns ``(data, scales)``: data (R, L) int8 or (R, ceil(L/2)) uint8, scales (R, nb) fp32.
    """
    qmax = _check_bits(bits)
    rows, length = x.shape
    nb = _num_blocks(length, block_size)
    xb = _pad_cols(x.float(), nb * block_size).view(rows, nb, block_size)
    step = xb.abs().amax(dim=2) / qmax  # (R, nb)
    safe = torch.where(step > 0, step, torch.ones_like(step))
    y = xb / safe.unsqueeze(2)  # division, not a reciprocal multiply: exact on the grid
    q = y.round_().clamp_(-qmax, qmax).to(torch.int8).view(rows, nb * block_size)
    if bits == 8:
        return q[:, :length].contiguous(), step
    even = length + (length & 1)
    q = F.pad(q, (0, max(0, even - q.shape[1])))[:, :even].to(torch.int16) & 0xF
    packed = (q[:, 0::2] << 4) | q[:, 1::2]
    return packed.to(torch.uint8), step


def dequantize_rows(data: torch.Tensor, scales: torch.Tensor, length: int, bits: int,
                    block_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_rows`: (R, L) tensor of ``dtype``."""
    _check_bits(bits)
    rows = data.shape[0]
    nb = _num_blocks(length, block_size)
    if scales.shape != (rows, nb):
        raise ValueError(f"scales shape {tuple(scales.shape)} != ({rows}, {nb})")
    if bits == 8:
        q = data
    else:
        b = data.to(torch.int16)
        nibbles = torch.stack(((b >> 4) & 0xF, b & 0xF), dim=2).view(rows, -1)
        q = (nibbles ^ 8) - 8  # sign-extend 4-bit two's complement
    q = _pad_cols(q[:, :length].float(), nb * block_size).view(rows, nb, block_size)
    out = q.mul_(scales.unsqueeze(2)).view(rows, nb * block_size)[:, :length]
    # step = fl(a/qmax) may round up, so qmax*step can overflow when a is within a few
    # ulps of the fp32 maximum; the true value is finite, so clamp back to it.
    out = out.clamp_(-_FMAX, _FMAX)
    return out.to(dtype) if dtype != torch.float32 else out.contiguous()


def quantize(x: torch.Tensor, bits: int = 8, block_size: int = 2048) -> QuantizedTensor:
    """Block-quantize ``x`` (any shape, flattened) to ``bits`` (4 or 8)."""
    data, scales = quantize_rows(x.reshape(1, -1), bits, block_size)
    return QuantizedTensor(data.view(-1), scales.view(-1), x.numel(), tuple(x.shape), bits, block_size)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rebuild the tensor (``q.shape``) from its codes; see the module docstring for the error."""
    out = dequantize_rows(q.data.view(1, -1), q.scales.view(1, -1), q.numel, q.bits, q.block_size, dtype)
    return out.view(q.shape)


# -- collectives -------------------------------------------------------------------------


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _sent(rows_bytes: int, n: int) -> int:
    """Bytes this rank sends when each of ``n`` ranks gets one of its ``rows_bytes`` chunks."""
    return rows_bytes * (n - 1)


def quantized_all_gather(shard: torch.Tensor, group: dist.ProcessGroup | None, bits: int = 8,
                         block_size: int = 2048, record: Recorder | None = None) -> torch.Tensor:
    """qwZ: all-gather equal-sized shards as block-quantized codes plus fp32 scales.

    Returns the flat concatenation (world·numel, in ``shard.dtype``) of every rank's
    dequantized shard, in group-rank order. Every rank's shard must have the same numel.
    The quantization round trip happens even when alone, so results do not depend on
    the group size. Each rank sends ``quantized_nbytes(numel)`` bytes to each peer.
    """
    n = _size(group)
    numel = shard.numel()
    data, scales = quantize_rows(shard.reshape(1, -1), bits, block_size)
    if n > 1:
        all_data = data.new_empty((n, data.shape[1]))
        all_scales = scales.new_empty((n, scales.shape[1]))
        all_gather_flat(all_data, data, group=group)
        all_gather_flat(all_scales, scales, group=group)
        data, scales = all_data, all_scales
        if record is not None:
            record("qwz_all_gather", n, _sent(quantized_nbytes(numel, bits, block_size), n))
    return dequantize_rows(data, scales, numel, bits, block_size, shard.dtype).view(-1)


def _all_to_all_rows(rows: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Row j of the input goes to group rank j; row j of the output came from group rank j."""
    out = torch.empty_like(rows)
    dist.all_to_all_single(out, rows.contiguous(), group=group)
    return out


def _exchange_reduce(rows: torch.Tensor, group: dist.ProcessGroup | None, bits: int | None,
                     block_size: int, op: str, record: Recorder | None) -> torch.Tensor:
    """One qgZ hop: rows (n, L) fp32, row j destined to group rank j; returns the sum of
    the n rows this rank receives. A hop of one rank sends nothing and quantizes nothing."""
    n, length = rows.shape
    if n == 1:
        return rows[0]
    if bits is None:
        received = _all_to_all_rows(rows, group)
        sent = rows[0].numel() * 4
    else:
        data, scales = quantize_rows(rows, bits, block_size)
        data, scales = _all_to_all_rows(data, group), _all_to_all_rows(scales, group)
        received = dequantize_rows(data, scales, length, bits, block_size)
        sent = quantized_nbytes(length, bits, block_size)
    if record is not None:
        record(op, n, _sent(sent, n))
    return received.sum(dim=0)


def quantized_reduce_scatter(grad: torch.Tensor, intra_group: dist.ProcessGroup | None,
                             inter_group: dist.ProcessGroup | None, bits: int | None = 4,
                             block_size: int = 2048, record: Recorder | None = None) -> torch.Tensor:
    """qgZ: the reduce-scatter *mean* of ``grad`` by a 2-hop quantized all-to-all.

    Ranks are laid out node-major, global rank ``p = n*D + d`` with D ranks per node and
    N nodes. ``intra_group`` holds the D ranks of this node (group rank = d),
    ``inter_group`` the N ranks with the same local index d (group rank = n).
    ``grad`` (numel divisible by P = N*D, flattened) is viewed as P partitions;
    partition p is returned to rank p, as fp32, like ``reduce_scatter`` then ``/P``.

    Hop 1: the partitions are reordered (N, D) -> (D, N) so that chunk j holds every
    node's partition for local index j; chunk j is quantized and sent to local rank j,
    the D received chunks are dequantized and summed. Hop 2: the node sum, as N chunks,
    is quantized and sent to node n's rank with the same local index; received chunks
    are dequantized, summed and divided by P. With ``bits=None`` nothing is quantized
    (a hierarchical reduce-scatter, exact up to fp32 summation order).

    Error: with ``e(a) = error_bound(a, bits)``, each element obeys
    ``|out - mean| <= (sum_{n,d} e(a1_{n,d}) + sum_n e(a2_n)) / P`` (plus fp32 summation
    rounding), a1 the absmax of its hop-1 block on rank (n,d), a2 that of its hop-2
    block on node n. Inter-node bytes are those of hop 2 only.
    """
    d_size, n_size = _size(intra_group), _size(inter_group)
    world = d_size * n_size
    numel = grad.numel()
    if numel % world:
        raise ValueError(f"qgZ needs numel divisible by world size {world}, got {numel}")
    chunk = numel // world
    # (N, D, c) -> (D, N, c): row j = all partitions destined to local index j
    swizzled = grad.reshape(n_size, d_size, chunk).float().transpose(0, 1).reshape(d_size, n_size * chunk)
    node_sum = _exchange_reduce(swizzled, intra_group, bits, block_size, "qgz_intra_all_to_all", record)
    total = _exchange_reduce(node_sum.view(n_size, chunk), inter_group, bits, block_size,
                             "qgz_inter_all_to_all", record)
    return total / world
