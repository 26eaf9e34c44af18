"""Collectives with byte accounting.

Counting convention (stated once, used by every test and report):
* ``logical`` elements per rank follow the ZeRO papers: an all-gather or a
  reduce-scatter of a tensor of n elements (the full, padded tensor) counts n, an
  all-reduce counts 2n (reduce-scatter + all-gather), a broadcast n.
* ``bytes`` is what this rank actually sends with a bandwidth-optimal algorithm:
  (N-1)/N of the logical volume, times the element size. ``inter_node_bytes`` is
  the part of it addressed to ranks on other nodes (node = rank // local_world_size),
  assuming each rank sends each peer its 1/N chunk.
* Each Comm has a ``name``: the mesh dimension it spans ("world", "dp", "tp", "pp",
  "ep", "edp", or a ZeRO++ node dimension); reports also sum by dimension.
* Each call carries a ``kind``: "param" (parameter gathers), "grad" (gradient
  reductions), "control" (norms, overflow flags, scalars), "activation"
  (tensor-parallel split pairs), "vocab" (the vocabulary-parallel embedding, head
  and cross-entropy) or "moe" (expert-parallel all-to-alls); the textbook ZeRO
  volumes concern param + grad.
At world size 1 nothing is sent and nothing is counted.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from zeal.dist.buffers import BufferPool
from zeal.dist.context import DistContext
from zeal.dist.forensics import LOG, on_failure
from zeal.dist.p2p import all_gather_p2p, reduce_scatter_p2p


@dataclass
class _Counter:
    calls: int = 0
    logical_elems: int = 0
    bytes: int = 0
    inter_node_bytes: int = 0

    def add(self, other: _Counter) -> None:
        self.calls += other.calls
        self.logical_elems += other.logical_elems
        self.bytes += other.bytes
        self.inter_node_bytes += other.inter_node_bytes


@dataclass
class CommStats:
    """Per (op, kind) counters for the current step and the whole run."""

    step: dict[tuple[str, str, str], _Counter] = field(default_factory=lambda: defaultdict(_Counter))
    last_step: dict[tuple[str, str, str], _Counter] = field(default_factory=dict)
    total: dict[tuple[str, str, str], _Counter] = field(default_factory=lambda: defaultdict(_Counter))

    def record(self, op: str, kind: str, logical: int, nbytes: int, inter: int, dim: str = "world") -> None:
        c = _Counter(1, logical, nbytes, inter)
        self.step[(op, kind, dim)].add(c)
        self.total[(op, kind, dim)].add(c)

    def end_step(self) -> None:
        self.last_step = dict(self.step)
        self.step = defaultdict(_Counter)

    @staticmethod
    def _summary(table: dict[tuple[str, str, str], _Counter]) -> dict:
        out: dict = {"by_op": {}, "by_kind": {}, "by_dim": {}}
        for (op, kind, dim), c in sorted(table.items()):
            for section, key in (("by_op", f"{op}/{kind}"), ("by_kind", kind), ("by_dim", dim)):
                agg = out[section].setdefault(key, vars(_Counter()).copy())
                for k, v in vars(c).items():
                    agg[k] += v
        return out

    def report(self) -> dict:
        return {"last_step": self._summary(self.last_step), "total": self._summary(self.total)}


# torch 2.13 renamed the flat collectives; older releases only have the old names. Looked up
# at each call (not bound at import), so a wrapper around torch.distributed sees them too.
def all_gather_flat(*args, **kwargs):
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def reduce_scatter_flat(*args, **kwargs):
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


class Comm:
    """A process group plus accounting. Every method takes the tensors it works on;
    ``async_op=True`` returns a handle with ``wait()`` (a no-op handle at world size 1).
    ``ranks`` are the group's global ranks in group order; ``name`` the mesh dimension."""

    def __init__(self, ctx: DistContext, group: dist.ProcessGroup | None = None,
                 ranks: list[int] | None = None, stats: CommStats | None = None, name: str = "world") -> None:
        self.ctx, self.name = ctx, name
        self.group = group if group is not None else ctx.group
        self.ranks = ranks if ranks is not None else list(range(ctx.world_size))
        self.size = len(self.ranks)
        self.stats = stats if stats is not None else CommStats()
        me = ctx.node
        self._remote_peers = sum(1 for r in self.ranks if ctx.node_of(r) != me)
        # gloo's flat collectives are 2-3x slower than pairwise sends (see zeal.dist.p2p)
        self.pairwise = self.active and dist.get_backend(self.group) == "gloo"
        self._me = self.ranks.index(ctx.rank) if ctx.rank in self.ranks else 0
        self._scratch = BufferPool()  # chunks received by reduce-scatters on more than 2 ranks
        self._key = tuple(self.ranks)  # the group, as hang forensics names it
        LOG.rank = ctx.rank

    @property
    def rank(self) -> int:
        """This process's position in the group (its index in ``ranks``)."""
        return self._me

    @property
    def active(self) -> bool:
        return self.size > 1 and self.group is not None

    def _account(self, op: str, kind: str, numel: int, elem_size: int, factor: int = 1) -> None:
        n = self.size
        chunk_bytes = numel * elem_size // n
        self.stats.record(op, kind, factor * numel, factor * chunk_bytes * (n - 1),
                          factor * chunk_bytes * self._remote_peers, self.name)

    def record(self, op: str, kind: str, logical: int, nbytes: int, inter: int) -> None:
        """Account a transfer this Comm's group made outside its methods (quantized ZeRO++ ops)."""
        self.stats.record(op, kind, logical, nbytes, inter, self.name)
        LOG.record(self.name, self._key, op)

    def all_reduce(self, t: torch.Tensor, kind: str, op=dist.ReduceOp.SUM, async_op: bool = False):
        if not self.active:
            return Done()
        self._account("all_reduce", kind, t.numel(), t.element_size(), factor=2)
        LOG.record(self.name, self._key, "all_reduce", t)
        return _watch(lambda: dist.all_reduce(t, op=op, group=self.group, async_op=async_op))

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, kind: str, async_op: bool = False):
        """``out`` (n·s elements) receives every rank's ``shard`` (s elements) in rank order;
        ``shard`` may be this rank's own chunk of ``out``."""
        if not self.active:
            if out.data_ptr() != shard.data_ptr():
                out.copy_(shard.view(out.shape))
            return Done()
        self._account("all_gather", kind, out.numel(), out.element_size())
        LOG.record(self.name, self._key, "all_gather", out)
        with torch.autograd._unsafe_preserve_version_counter(out):
            if self.pairwise:
                work = _watch(lambda: all_gather_p2p(out, shard, self.group, self._me, self.size))
                if not async_op:
                    work.wait()
            else:
                if shard.untyped_storage().data_ptr() == out.untyped_storage().data_ptr():
                    shard = shard.clone()  # the flat collective may not read and write one buffer
                work = _watch(lambda: all_gather_flat(out, shard, group=self.group, async_op=async_op))
        return work

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, kind: str, async_op: bool = False):
        """``out`` (s elements) receives the sum over ranks of this rank's chunk of ``full``."""
        if not self.active:
            out.copy_(full.view(out.shape))
            return Done()
        self._account("reduce_scatter", kind, full.numel(), full.element_size())
        LOG.record(self.name, self._key, "reduce_scatter", full)
        if not self.pairwise:
            return _watch(lambda: reduce_scatter_flat(out, full, group=self.group, async_op=async_op))
        work = _watch(lambda: reduce_scatter_p2p(out, full, self.group, self._me, self.size, self._scratch))
        if not async_op:
            work.wait()
        return work

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, kind: str) -> None:
        """Rank i's ``out`` chunk j (dim 0 split into ``size`` equal chunks) receives rank j's
        ``inp`` chunk i. Counts ``inp.numel()`` logical elements; the bytes leaving this rank
        are the (N-1)/N of ``inp`` addressed to the other ranks."""
        if not self.active:
            out.copy_(inp)
            return
        self._account("all_to_all", kind, inp.numel(), inp.element_size())
        dist.all_to_all_single(out, inp.contiguous(), group=self.group)

    def broadcast(self, t: torch.Tensor, src: int, kind: str) -> None:
        if not self.active:
            return
        self._account("broadcast", kind, t.numel(), t.element_size())
        LOG.record(self.name, self._key, "broadcast", t)
        with torch.autograd._unsafe_preserve_version_counter(t):
            _watch(lambda: dist.broadcast(t, src=self.ranks[src], group=self.group))

    def all_reduce_scalar(self, value: float, op: str = "sum") -> float:
        """All-reduce one float (control traffic); returns it unchanged at world size 1."""
        if not self.active:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.ctx.device)
        red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        self.all_reduce(t, "control", op=red)
        return float(t.item())


    # -- point to point (pipeline stages) -----------------------------------------------
    def _account_p2p(self, op: str, kind: str, t: torch.Tensor, peer: int) -> None:
        nbytes = t.numel() * t.element_size()
        remote = self.ctx.node_of(self.ranks[peer]) != self.ctx.node
        self.stats.record(op, kind, t.numel(), nbytes if op == "send" else 0,
                          nbytes if remote and op == "send" else 0, self.name)

    def isend(self, t: torch.Tensor, dst: int, kind: str, tag: int = 0):
        """Send ``t`` to the group's rank ``dst`` (its index in ``ranks``); returns a handle.
        Counted as ``send`` (the bytes) on this rank and ``recv`` (elements only) on the peer."""
        self._account_p2p("send", kind, t, dst)
        LOG.record(self.name, (self.ctx.rank, self.ranks[dst]), "send", t)
        return _watch(lambda: dist.isend(t, group=self.group, group_dst=dst, tag=tag))

    def irecv(self, t: torch.Tensor, src: int, kind: str, tag: int = 0):
        """Receive into ``t`` from the group's rank ``src``; returns a handle."""
        self._account_p2p("recv", kind, t, src)
        LOG.record(self.name, (self.ranks[src], self.ctx.rank), "send", t)
        return _watch(lambda: dist.irecv(t, group=self.group, group_src=src, tag=tag))

    def send(self, t: torch.Tensor, dst: int, kind: str, tag: int = 0) -> None:
        self.isend(t, dst, kind, tag).wait()

    def recv(self, t: torch.Tensor, src: int, kind: str, tag: int = 0) -> None:
        self.irecv(t, src, kind, tag).wait()


def _watch(start) -> object:
    """Run ``start()`` (a collective); a failure (a timeout) dumps the forensics records.
    An asynchronous handle is wrapped so that a failure at ``wait()`` dumps them too."""
    try:
        work = start()
    except Exception as e:
        on_failure(e)
        raise
    return Done() if work is None else _Watched(work)


class _Watched:
    """A collective's handle whose failing ``wait()`` dumps the forensics records."""

    def __init__(self, work) -> None:
        self._work = work

    def wait(self, *args) -> bool:
        try:
            self._work.wait(*args)
        except Exception as e:
            on_failure(e)
            raise
        return True

    def __getattr__(self, name: str):
        return getattr(self._work, name)


class Done:
    """The handle of a collective that already finished (or never had to run)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True
