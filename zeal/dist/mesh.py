"""The device mesh: every process group zeal uses, built once, handed out as accounted Comms.

Rank layout (Megatron's order, tensor-parallel ranks adjacent so they share a node):

    rank = pp_rank · (dp · tp) + dp_rank · tp + tp_rank

* ``tp`` groups: ``tp`` consecutive ranks; ``dp`` groups: ranks with the same pp and tp
  coordinates (stride ``tp``); ``pp`` groups: ranks with the same dp and tp coordinates
  (stride ``dp · tp``).
* Expert parallelism splits the data-parallel group, as in DeepSpeed-MoE:
  ``dp = ep · edp``. Within a dp group (in dp order), an ``ep`` group is ``ep``
  consecutive members and an ``edp`` (expert-data-parallel) group takes every
  ``ep``-th member. Non-expert gradients are reduced over ``dp``, expert gradients over
  ``edp``.
* Sequence parallelism (DeepSpeed-Ulysses) also splits the data-parallel group, as
  DeepSpeed's ``sequence_data_parallel`` arrangement does: within a dp group (in dp order)
  an ``sp`` group is ``sp`` consecutive members (with tp, ranks ``tp`` apart: Megatron's
  tp-cp-dp order). The dp group stays the group parameters are replicated over (ZeRO
  shards over dp = data × sp, gradients are averaged over it); the members of an sp group
  read the same samples, so the data-parallel size of the batch arithmetic and the
  samplers is ``data_size = dp / sp``.
* The ZeRO++ node dimension lives inside the dp group: ``intra`` is the dp members on
  this rank's node, ``inter`` the dp members holding the same position on every node,
  ``hpz`` blocks of ``hpz`` consecutive dp members (secondary partitions).

Every rank creates every group of every dimension, in one fixed order (torch requires
it); a dimension of size 1 creates none, and a dimension spanning the whole world reuses
the default group. All Comms of a mesh share one :class:`CommStats`, so
``comm_stats()`` counts every collective of the process, each under its dimension.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from zeal.dist.comm import Comm, CommStats
from zeal.dist.context import DistContext

DIMS = ("dp", "tp", "pp", "ep", "edp", "sp")
NODE_DIMS = ("intra", "inter", "hpz")


def layout(world: int, tp: int = 1, pp: int = 1, ep: int = 1, sp: int = 1) -> dict[str, list[list[int]]]:
    """Every group of every dimension as lists of global ranks (pure; no process group).

    Raises ValueError naming the sizes when they do not tile ``world``."""
    for name, n in (("tp", tp), ("pp", pp), ("ep", ep), ("sp", sp)):
        if n < 1:
            raise ValueError(f"mesh size {name}={n} must be >= 1")
    if world % (tp * pp):
        raise ValueError(f"tensor parallel {tp} x pipeline parallel {pp} does not divide world size {world}")
    dp = world // (tp * pp)
    if dp % ep:
        raise ValueError(f"expert parallel {ep} does not divide the data-parallel size {dp} "
                         f"(world {world} / (tp {tp} x pp {pp}))")

    def rank(p: int, d: int, t: int) -> int:
        return p * dp * tp + d * tp + t

    groups: dict[str, list[list[int]]] = {
        "tp": [[rank(p, d, t) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "dp": [[rank(p, d, t) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[rank(p, d, t) for p in range(pp)] for d in range(dp) for t in range(tp)],
    }
    groups["ep"] = [g[i:i + ep] for g in groups["dp"] for i in range(0, dp, ep)]
    groups["edp"] = [g[i::ep] for g in groups["dp"] for i in range(ep)]
    if dp % sp:
        raise ValueError(f"sequence_parallel_size {sp} does not divide the data-parallel size {dp} "
                         f"(world {world} / (tp {tp} x pp {pp}))")
    groups["sp"] = [g[i:i + sp] for g in groups["dp"] for i in range(0, dp, sp)]
    return groups


def node_layout(dp_groups: list[list[int]], local_world_size: int, hpz: int = 1) -> dict[str, list[list[int]]]:
    """The ZeRO++ sub-groups of each dp group: same node, same position on each node, hpZ."""
    out: dict[str, list[list[int]]] = {"intra": [], "inter": [], "hpz": []}
    for g in dp_groups:
        if len(g) % hpz:
            raise ValueError(f"zero_optimization.zero_hpz_partition_size {hpz} does not divide "
                             f"the data-parallel size {len(g)}")
        nodes: dict[int, list[int]] = {}
        for r in g:
            nodes.setdefault(r // local_world_size, []).append(r)
        per_node = list(nodes.values())
        out["intra"] += per_node
        width = min(len(n) for n in per_node)
        out["inter"] += [[n[i] for n in per_node] for i in range(width)]
        out["hpz"] += [g[i:i + hpz] for i in range(0, len(g), hpz)]
    return out


@dataclass
class Mesh:
    """This process's place in the mesh and an accounted :class:`Comm` per dimension.

    ``mesh.dp`` / ``mesh.tp`` / ``mesh.pp`` / ``mesh.ep`` / ``mesh.edp`` / ``mesh.sp`` / ``mesh.world``
    are Comms (inactive at size 1, so the same code runs alone); ``*_rank`` / ``*_size``
    are this rank's coordinates. Built by :func:`build_mesh`."""

    ctx: DistContext
    sizes: dict[str, int]
    coords: dict[str, int]
    comms: dict[str, Comm]
    stats: CommStats = field(default_factory=CommStats)

    # -- Comms ------------------------------------------------------------------------------
    @property
    def world(self) -> Comm:
        return self.comms["world"]

    @property
    def dp(self) -> Comm:
        return self.comms["dp"]

    @property
    def tp(self) -> Comm:
        return self.comms["tp"]

    @property
    def pp(self) -> Comm:
        return self.comms["pp"]

    @property
    def ep(self) -> Comm:
        return self.comms["ep"]

    @property
    def edp(self) -> Comm:
        return self.comms["edp"]

    @property
    def sp(self) -> Comm:
        return self.comms["sp"]

    def comm(self, dim: str) -> Comm:
        """The Comm of ``dim`` (one of DIMS, "world", or a ZeRO++ node dimension when built)."""
        try:
            return self.comms[dim]
        except KeyError:
            raise KeyError(f"the mesh has no dimension {dim!r}; it has {sorted(self.comms)}") from None

    # -- coordinates -----------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def dp_size(self) -> int:
        return self.sizes["dp"]

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def tp_size(self) -> int:
        return self.sizes["tp"]

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    @property
    def pp_size(self) -> int:
        return self.sizes["pp"]

    @property
    def ep_rank(self) -> int:
        return self.coords["ep"]

    @property
    def ep_size(self) -> int:
        return self.sizes["ep"]

    @property
    def edp_rank(self) -> int:
        return self.coords["edp"]

    @property
    def edp_size(self) -> int:
        return self.sizes["edp"]

    @property
    def sp_rank(self) -> int:
        return self.coords.get("sp", 0)

    @property
    def sp_size(self) -> int:
        return self.sizes.get("sp", 1)

    @property
    def data_size(self) -> int:
        """Ranks reading different samples: the dp size over the sequence-parallel size
        (what the batch arithmetic and the samplers count; DeepSpeed's ``dp_world_size``)."""
        return self.sizes["dp"] // self.sp_size

    @property
    def data(self) -> Comm:
        """The Comm of the ranks reading different samples (the dp Comm at sp 1)."""
        return self.comms.get("data") or self.comms["dp"]

    @property
    def data_rank(self) -> int:
        """This rank's position among the ranks reading different samples."""
        return self.coords["dp"] // self.sp_size

    @property
    def hpz_index(self) -> int:
        """This rank's position inside its hpZ group (0 without ZeRO++ groups)."""
        hpz = self.comms.get("hpz")
        return hpz.ranks.index(self.rank) if hpz is not None else 0

    def describe(self) -> str:
        """One line: the sizes of every dimension and this rank's coordinates."""
        dims = " x ".join(f"{d}={self.sizes[d]}" for d in ("pp", "dp", "tp") if self.sizes[d] > 1) or "single"
        sp = f", sp={self.sp_size}" if self.sp_size > 1 else ""
        return f"mesh {dims} (ep={self.ep_size}{sp}); rank {self.rank}: " + \
            ", ".join(f"{d}_rank={self.coords[d]}" for d in DIMS)


def build_mesh(ctx: DistContext | None = None, *, dp: int | None = None, tp: int = 1, pp: int = 1, ep: int = 1,
               hpz: int | None = None, sp: int = 1) -> Mesh:
    """Create every group of the layout on this rank (collectively: all ranks call this
    with the same sizes). ``ctx`` defaults to joining torchrun's job
    (:func:`~zeal.dist.context.init_distributed`); ``dp`` defaults to what the other sizes
    leave of the world (given, it must match). ``hpz`` (the ZeRO++ secondary-partition
    size) also builds the node dimensions ``intra``, ``inter`` and ``hpz``; None builds none."""
    if ctx is None:
        from zeal.dist.context import init_distributed

        ctx = init_distributed()
    if dp is not None and dp * tp * pp != ctx.world_size:
        raise ValueError(f"mesh dp {dp} x tp {tp} x pp {pp} = {dp * tp * pp} != world size {ctx.world_size}")
    groups = layout(ctx.world_size, tp, pp, ep, sp)
    if hpz is not None:
        groups.update(node_layout(groups["dp"], ctx.local_world_size, hpz))
    stats = CommStats()
    comms = {"world": Comm(ctx, stats=stats, name="world")}
    coords: dict[str, int] = {}
    for dim in (*DIMS, *(NODE_DIMS if hpz is not None else ())):
        ranks, group = _create_groups(ctx, groups[dim])
        coords[dim] = ranks.index(ctx.rank)
        comms[dim] = Comm(ctx, group=group, ranks=ranks, stats=stats, name=dim)
    if sp > 1:  # the ranks reading different samples (DeepSpeed's data-parallel group under sp)
        ranks, group = _create_groups(ctx, [g[i::sp] for g in groups["dp"] for i in range(sp)])
        comms["data"] = Comm(ctx, group=group, ranks=ranks, stats=stats, name="data")
    else:
        comms["data"] = comms["dp"]
    sizes = {d: len(comms[d].ranks) for d in DIMS}
    return Mesh(ctx, sizes, coords, comms, stats)


def _create_groups(ctx: DistContext, groups: list[list[int]]) -> tuple[list[int], dist.ProcessGroup | None]:
    """Create the groups of one dimension (every rank, same order); return this rank's."""
    mine = next(g for g in groups if ctx.rank in g)
    if len(mine) == 1:
        return mine, None
    if len(mine) == ctx.world_size:
        return mine, ctx.group
    handle = None
    for g in groups:
        pg = dist.new_group(g)
        if ctx.rank in g:
            handle = pg
    return mine, handle
