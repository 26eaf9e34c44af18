"""ZeRO++ for stage 3: how a unit is gathered and how its gradient is reduced.

* qwZ — the forward all-gather sends int8 block-quantized shards (plus one fp32
  scale per block) and dequantizes on arrival.
* hpZ — the forward gather also leaves each rank a *secondary* shard: its slice of
  the unit within its hpZ group (G consecutive ranks, normally one node). The
  backward gather then runs inside that group only, so it sends no byte across
  nodes. Cost: 2Ψ/G bytes more per rank (bf16), held from forward to backward.
  Secondary shards are dropped after each optimizer step (the values changed).
* qgZ — the gradient reduce-scatter is replaced by two quantized all-to-alls
  (inside the node, then across nodes; :func:`zeal.dist.quant.quantized_reduce_scatter`).

With every option off, these strategies are exactly the plain collectives, so the
coordinator and reducer have a single code path.

Streams: each gather (with its shard's upload from a host or disk home, and qwZ's
quantization) is issued on a gather stream, each reduce-scatter (and qgZ's work) on a
reduce stream, after those streams wait for the compute issued so far; the handle's
``wait()`` makes the stream that calls it (the compute stream) wait on an event, so compute
never waits for a collective it does not need and the host does not block. Off CUDA the
streams are the identity (:mod:`zeal.utils.streams`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from zeal.config.schema import ZeroConfig
from zeal.dist.comm import Comm, Done, all_gather_flat
from zeal.dist.mesh import Mesh
from zeal.dist.quant import dequantize_rows, quantize_rows, quantized_nbytes, quantized_reduce_scatter
from zeal.utils.streams import current_stream, side_stream
from zeal.zero.shard_home import DiskShards, MemoryShards
from zeal.zero.units import FlatUnit


@dataclass
class Topology:
    """Sub-groups of the data-parallel group (from the mesh): this rank's node
    (``intra``), the ranks sharing its position on every node (``inter``) and its hpZ
    group."""

    intra: Comm
    inter: Comm
    hpz: Comm
    hpz_index: int


def topology(mesh: Mesh) -> Topology | None:
    """The ZeRO++ Comms of ``mesh`` (built when the config asks for ZeRO++), or None when
    the mesh has none or the data-parallel group is this rank alone."""
    if "hpz" not in mesh.comms or not mesh.dp.active:
        return None
    return Topology(mesh.comm("intra"), mesh.comm("inter"), mesh.comm("hpz"), mesh.hpz_index)


class Then:
    """A handle: wait for ``works``, then run ``fn`` once."""

    def __init__(self, works: list, fn) -> None:
        self.works, self.fn, self.done = works, fn, False

    def wait(self) -> bool:
        if not self.done:
            for w in self.works:
                w.wait()
            self.fn()
            self.done = True
        return True


class OnStream:
    """A handle for work issued on a side stream: ``wait()`` completes ``work`` for the
    calling stream, then makes that stream wait for the side stream's event."""

    def __init__(self, work, event, current: Callable[[], object]) -> None:
        self.work, self.event, self.current = work, event, current

    def wait(self):
        out = self.work.wait()
        self.current().wait_event(self.event)
        return out


@dataclass
class UnitCollectives:
    """The stage-3 gather and gradient-reduce strategies (plain or ZeRO++)."""

    world: Comm  # the data-parallel Comm the units are sharded over
    zc: ZeroConfig
    topo: Topology | None = None
    home: MemoryShards | DiskShards = field(default_factory=MemoryShards)
    secondary: dict[int, torch.Tensor] = field(default_factory=dict)
    new_stream: Callable[[torch.device], object] = side_stream  # tests: a recording fake
    current: Callable[[torch.device], object] = current_stream
    streams: dict[str, object] = field(default_factory=dict)

    @property
    def hpz(self) -> bool:
        return self.topo is not None and self.zc.zero_hpz_partition_size > 1

    def _on_stream(self, kind: str, issue: Callable[[], object], *tensors: torch.Tensor):
        """Run ``issue`` on the ``kind`` stream after the compute issued so far; ``tensors``
        (made on the compute stream) are kept until that stream's work is done."""
        device = tensors[0].device
        stream = self.streams.get(kind)
        if stream is None:
            stream = self.streams[kind] = self.new_stream(device)
        stream.wait_stream(self.current(device))
        with stream:
            work = issue()
        for t in tensors:
            stream.keep(t)
        return OnStream(work, stream.record_event(), lambda: self.current(device))

    def gather(self, u: FlatUnit, backward: bool):
        """Start filling ``u.full`` (storage allocated) from the shards, on the gather stream;
        returns a handle whose ``wait()`` completes the gather (dequantize, keep the hpZ
        secondary, give a swap buffer back), so prefetch overlaps every variant."""
        return self._on_stream("gather", lambda: self._gather(u, backward), u.full)

    def _gather(self, u: FlatUnit, backward: bool):
        if backward and u.index in self.secondary:  # hpZ: inside the group only
            return self.topo.hpz.all_gather(u.full, self.secondary[u.index], "param", async_op=True)
        shard = self.home.get(u)
        if self.zc.zero_quantized_weights and self.world.active:
            work = self._quantized_gather(u, shard)
        else:
            work = self.world.all_gather(u.full, shard, "param", async_op=True)
        if self.home.on_disk:  # give the swap buffer back at once: prefetch must never exhaust the pool
            work.wait()
            self.home.done(u)
        if self.hpz:
            g = self.topo.hpz.size
            lo = self.topo.hpz_index * (u.padded // g)

            def keep_secondary() -> None:
                self.secondary[u.index] = u.full[lo:lo + u.padded // g].clone()

            work = Then([work], keep_secondary)
        return work

    def _quantized_gather(self, u: FlatUnit, shard: torch.Tensor) -> Then:
        """qwZ: all-gather int8 codes and fp32 block scales; dequantize on wait()."""
        bits, block = self.zc.zero_quantized_weights_bits, self.zc.zero_quantization_block_size
        n, group = self.world.size, self.world.group
        data, scales = quantize_rows(shard.reshape(1, -1), bits, block)
        all_data = data.new_empty((n, data.shape[1]))
        all_scales = scales.new_empty((n, scales.shape[1]))
        works = [all_gather_flat(all_data, data, group=group, async_op=True),
                 all_gather_flat(all_scales, scales, group=group, async_op=True)]
        sent = quantized_nbytes(u.shard_numel, bits, block)
        self.world.record("qwz_all_gather", "param", u.padded, sent * (n - 1), sent * self.world._remote_peers)

        def dequantize() -> None:
            full = dequantize_rows(all_data, all_scales, u.shard_numel, bits, block, u.dtype).view(-1)
            with torch.autograd._unsafe_preserve_version_counter(u.full):
                u.full.copy_(full)

        return Then(works, dequantize)

    def refresh(self, u: FlatUnit) -> None:
        """All-gather a persistent unit after its shard changed (full precision)."""
        shard = self.home.get(u)
        self.world.all_gather(u.full, shard, "param")
        self.home.done(u)

    def drop_secondary(self) -> None:
        self.secondary.clear()

    def reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor):
        """``out`` gets the *sum* over ranks of this rank's chunk of ``flat`` (on the reduce stream)."""
        return self._on_stream("reduce", lambda: self._reduce_scatter(out, flat), out, flat)

    def _reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor):
        if not (self.zc.zero_quantized_gradients and self.world.active and self.topo is not None):
            return self.world.reduce_scatter(out, flat, "grad", async_op=True)
        bits, block = self.zc.zero_quantized_gradients_bits, self.zc.zero_quantization_block_size
        n = self.world.size

        def record(op: str, group_size: int, nbytes: int) -> None:
            across = op.startswith("qgz_inter")
            logical = flat.numel() if op.startswith("qgz_intra") else 0  # count Ψ once per reduction
            (self.topo.inter if across else self.topo.intra).record(op, "grad", logical, nbytes,
                                                                    nbytes if across else 0)

        mean = quantized_reduce_scatter(flat, self.topo.intra.group, self.topo.inter.group, bits=bits,
                                        block_size=block, record=record)
        out.copy_(mean.mul_(n))
        return Done()
