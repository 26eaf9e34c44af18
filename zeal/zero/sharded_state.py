"""The public sharded-state API: what each rank holds of every parameter, as N-d slices.

For every parameter: its name, global shape, and the boxes (N-d slices, see
:mod:`zeal.zero.slices`) of it this rank *owns*, each with its master values (fp32 for
trainable parameters; the model's own dtype for frozen ones) and its optimizer state
for that box (moments of the box's shape; scalars such as Adam's step). Over the ranks
of the data-parallel group the owned boxes tile every parameter exactly once, whatever
the stage: a saver writes each element once. Under tensor parallelism a split
parameter's boxes are this rank's slice of the *global* tensor (so a checkpoint saved at
TP 2 loads at TP 1), and a replicated one is owned by tp rank 0 (held by every tp rank):
the owned boxes then tile every parameter once over the whole world. A parameter of a
CommGroup (:mod:`zeal.zero.groups`) is held by that group's ranks only and its boxes are
partitioned over that group, so over the world it is again owned once.

ZeRO partitions the *flat* buffer of a unit of parameters, so a rank's shard of one
parameter is a flat range of the flattened parameter. It is described here by the boxes
of :func:`~zeal.zero.slices.flat_range_boxes`: each is contiguous in the flat shard, so
the tensors handed out are views of the live masters and moments (no copy), and a
reader that wants another layout (another world size, a tensor-parallel column block)
intersects boxes instead of flat ranges.

What a rank owns and what it *holds* can differ: stage 0 keeps the whole master (and
moments) of every unit on every rank, and frozen parameters outside flat units are
replicated; these are owned by partition (so that saving is shared) but a load must
fill all of what is held. :func:`load_sharded_state` therefore asks its caller for the
values of every held box, writes them, and re-synchronises the model copy.

Communication: :func:`sharded_state` none; :func:`load_sharded_state` one small
all-gather to agree on errors, then the parameter all-gathers of the write-back
(stages 1–2) or of persistent units (stage 3), which are not counted as training
traffic. All ranks must call :func:`load_sharded_state` together.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from zeal.dist.agree import first_error
from zeal.dist.comm import Comm
from zeal.zero.groups import comm_of
from zeal.zero.partition import padded_size, shard_range, slot_overlap
from zeal.zero.slices import Box, box_numel, box_shape, flat_range_boxes, flat_start, full_box, index

__all__ = ["Box", "ParamInfo", "ParamShard", "ShardedState", "ShardedStateError", "dp_comm",
           "load_sharded_state", "param_infos", "sharded_state", "state_comm"]


@dataclass(frozen=True)
class ParamInfo:
    """One parameter of the model (the same on every rank)."""

    name: str  # first name in ``module.named_parameters()`` (tied aliases share it)
    shape: tuple[int, ...]  # global shape
    dtype: torch.dtype  # dtype of the master values: fp32 when trainable, else the model's
    model_dtype: torch.dtype  # dtype of the model's copy (the compute dtype when trainable)
    trainable: bool
    group: int | None  # optimizer param-group index (None when frozen)


@dataclass
class ParamShard:
    """One box of one parameter: the values a rank owns (from :func:`sharded_state`) or
    is given (for :func:`load_sharded_state`). ``master``, every moment has the shape
    of the box; ``scalars`` is the optimizer's per-parameter scalar state."""

    info: ParamInfo
    box: Box  # ((start, stop), ...) per dimension of info.shape
    master: torch.Tensor
    moments: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.info.name


@dataclass
class ShardedState:
    """What this rank owns (``shards``), plus the replicated description and counters."""

    rank: int
    world_size: int
    params: dict[str, ParamInfo]  # every parameter, in module order
    shards: list[ParamShard]  # owned boxes, views of live state: read-only, valid inside the with-block
    skipped_steps: int
    loss_scaler: dict | None


class ShardedStateError(RuntimeError):
    """A load failed on some rank; every rank raises it with that rank's message."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


Reader = Callable[[ParamInfo, Box], ParamShard]


# -- the one place that knows the engine's private parts -------------------------------------
def dp_comm(engine: Any) -> Comm:
    """The data-parallel group the ZeRO state is partitioned over."""
    return engine.mesh.dp


def state_comm(engine: Any) -> Comm:
    """Every rank holding a part of the state (the world: under tensor parallelism each tp
    rank holds other slices); checkpoints agree and name their files over it."""
    return engine.mesh.world


@dataclass
class _Parts:
    module: nn.Module
    units: list  # [FlatUnit]
    zopt: Any  # ZeroOptimizer or SwappedZeroOptimizer
    coordinator: Any  # ParamCoordinator or None (below stage 3)
    scaler: Any  # LossScaler or None
    comm: Comm
    rank: int
    world: int
    tp: Any = None  # zeal.parallel.TensorParallel, or None
    agree: Comm | None = None  # state_comm: where errors are agreed
    comm_groups: list = field(default_factory=list)  # CommGroups: parameters held by a sub-group


def _parts(engine: Any) -> _Parts:
    p, mesh = engine._p, engine.mesh
    return _Parts(engine.module, p.units, p.zero_optimizer, p.coordinator, p.scaler, dp_comm(engine),
                  mesh.dp_rank, mesh.dp_size, getattr(engine, "tensor_parallel", None),
                  state_comm(engine), getattr(p, "comm_groups", []))


@contextlib.contextmanager
def _resident(parts: _Parts, writeback: bool) -> Iterator[None]:
    """State kept on disk by ZeRO-Infinity, in memory for the duration of the block."""
    from zeal.zero.offload_view import in_memory

    home = parts.coordinator.coll.home if parts.coordinator is not None else None
    with in_memory(parts.zopt, home, parts.units, writeback):
        yield


# -- where each box lives ---------------------------------------------------------------------
@dataclass
class _Target:
    """A box of a parameter and where its values live on this rank."""

    info: ParamInfo
    box: Box
    values: torch.Tensor  # view of the live storage (box shape)
    master: torch.Tensor | None  # the flat master holding it (trainable), for the optimizer state
    offset: int  # flat offset inside ``master`` of the local (contiguous) box holding this one
    local_shape: tuple[int, ...] = ()  # shape of that local box
    sub: tuple[slice, ...] | None = None  # this box inside it (tensor-parallel fused parts), or all


def _view(flat: torch.Tensor, t: _Target) -> torch.Tensor:
    """The part of a flat tensor shaped like ``t.master`` that holds ``t``'s box."""
    n = 1
    for d in t.local_shape:
        n *= d
    v = flat.view(-1)[t.offset:t.offset + n].view(t.local_shape)
    return v if t.sub is None else v[t.sub]


def _global_boxes(parts: _Parts, name: str, box: Box, owned: bool) -> list[tuple[Box, tuple[slice, ...] | None]]:
    """A box of this rank's (local) parameter as boxes of the global parameter, each with
    its place in the local box; a replicated parameter under tensor parallelism is owned
    by tp rank 0 only (held by all)."""
    tp = parts.tp
    split = tp.splits.get(name) if tp is not None else None
    if split is None:
        return [] if owned and tp is not None and tp.rank != 0 else [(box, None)]
    a, b = box[split.dim]
    out = []
    for lo, g, n in split.segments:
        x, y = max(a, lo), min(b, lo + n)
        if x >= y:
            continue
        gbox = tuple((g + x - lo, g + y - lo) if d == split.dim else r for d, r in enumerate(box))
        sub = tuple(slice(x - a, y - a) if d == split.dim else slice(None) for d in range(len(box)))
        out.append((gbox, None if (x, y) == (a, b) else sub))
    return out


def _infos(parts: _Parts) -> dict[str, ParamInfo]:
    info: dict[str, ParamInfo] = {}
    splits = parts.tp.splits if parts.tp is not None else {}

    def shape(name: str, local: tuple[int, ...]) -> tuple[int, ...]:
        return splits[name].global_shape if name in splits else local

    for u in parts.units:
        for slot in u.slots:
            info[slot.name] = ParamInfo(slot.name, shape(slot.name, tuple(slot.shape)),
                                        torch.float32 if u.trainable else u.dtype,
                                        u.dtype, u.trainable, u.group if u.trainable else None)
    for n, q in _loose(parts):
        info[n] = ParamInfo(n, shape(n, tuple(q.shape)), q.dtype, q.dtype, False, None)
    order = [n for n, _ in parts.module.named_parameters()]
    return {n: info[n] for n in order if n in info}


def _loose(parts: _Parts) -> list[tuple[str, nn.Parameter]]:
    """Parameters outside flat units (frozen ones below stage 3): replicated on every rank."""
    in_units = {id(q) for u in parts.units for q in u.params}
    return [(n, q) for n, q in parts.module.named_parameters() if id(q) not in in_units]


def _targets(parts: _Parts, owned: bool) -> Iterator[_Target]:
    """Every box this rank owns (``owned``) or holds, with a view of its live values."""
    infos = _infos(parts)
    zopt = parts.zopt
    master_of = {id(u): m for u, m in zip(zopt.units, zopt.masters)}
    for u in parts.units:
        m = master_of.get(id(u))
        # src holds elements [base, base + src.numel()) of the unit's padded flat buffer
        if m is not None:
            # the stage says what the master covers: the whole unit (stage 0) or this rank's shard
            src, base = m.data.view(-1), zopt.stage.owned_start(u)
        else:
            src, base = u.shard, u.start
        lo, hi = (u.start, u.end) if owned else (base, base + src.numel())
        for slot in u.slots:
            ov = slot_overlap(slot, lo, hi)
            if ov is None:
                continue
            for box in flat_range_boxes(slot.shape, *ov):
                off = slot.offset + flat_start(slot.shape, box) - base
                view = src[off:off + box_numel(box)].view(box_shape(box))
                for gbox, sub in _global_boxes(parts, slot.name, box, owned):
                    yield _Target(infos[slot.name], gbox, view if sub is None else view[sub], m, off,
                                  box_shape(box), sub)
    for n, q in _loose(parts):
        if owned:  # shared by the flat partition of the parameter, as units are
            c = comm_of(parts.comm_groups, None, q)  # a CommGroup's parameter is shared over its Comm
            rank, world = (c.rank, c.size) if c is not None else (parts.rank, parts.world)
            lo, hi = shard_range(padded_size(q.numel(), world), rank, world)
            boxes = flat_range_boxes(q.shape, min(lo, q.numel()), min(hi, q.numel()))
        else:
            boxes = [full_box(q.shape)]
        for box in boxes:
            for gbox, sub in _global_boxes(parts, n, box, owned):
                view = q.data[index(box)]
                yield _Target(infos[n], gbox, view if sub is None else view[sub], None, 0)


def _optimizer_views(opt: Any, t: _Target) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Moments (views of the box) and scalars of the optimizer state behind a target."""
    moments, scalars = {}, {}
    if t.master is None:
        return moments, scalars
    for k, v in opt.state.get(t.master, {}).items():
        if isinstance(v, torch.Tensor) and v.shape == t.master.shape:
            moments[k] = _view(v, t)
        elif isinstance(v, (bool, int, float)) or (isinstance(v, torch.Tensor) and v.dim() == 0):
            scalars[k] = v
        else:
            raise ValueError(f"optimizer state {k!r} of {t.info.name}: neither of the master's shape "
                             f"{tuple(t.master.shape)} nor a scalar")
    return moments, scalars


# -- the API --------------------------------------------------------------------------------------
def param_infos(engine: Any) -> dict[str, ParamInfo]:
    """Every parameter of the whole model with its *global* shape, as a checkpoint
    describes it: the engine's ``global_params`` (set by the apply-steps that split the model across ranks: pipeline stages, ...),
    else this rank's parameters with the global shape of each tensor-parallel split.
    Communicates nothing; reads no offloaded state."""
    whole = getattr(engine, "global_params", None)
    return whole if whole is not None else _infos(_parts(engine))


@contextlib.contextmanager
def sharded_state(engine: Any, local: bool = False) -> Iterator[ShardedState]:
    """``with sharded_state(engine) as st:`` — this rank's owned boxes of every parameter,
    as views of the live masters and optimizer state (no copy; for the disk tier, the
    state is read into memory for the block). Do not write into them; clone what must
    outlive the block or the next optimizer step. Communicates nothing.

    With pipeline stages, ``st.params`` describes the whole model (the engine's
    ``global_params``; ``local=True``: this stage's only) and ``st.rank`` / ``st.world_size``
    are the global ones (every rank owns its stage's boxes)."""
    parts = _parts(engine)
    with _resident(parts, writeback=False):
        opt = parts.zopt.optimizer
        shards = []
        for t in _targets(parts, owned=True):
            moments, scalars = _optimizer_views(opt, t)
            shards.append(ParamShard(t.info, t.box, t.values, moments, scalars))
        whole = None if local else getattr(engine, "global_params", None)
        yield ShardedState(parts.agree.ctx.rank, parts.agree.size, whole or _infos(parts), shards,
                           parts.zopt.skipped_steps,
                           parts.scaler.state_dict() if parts.scaler is not None else None)


def load_sharded_state(engine: Any, read: Reader, *, load_optimizer: bool = True,
                       skipped_steps: int | None = None, loss_scaler: dict | None = None) -> None:
    """Set this rank's state from ``read(info, box) -> ParamShard`` (called once for every
    box this rank holds, which may be more than it owns: see the module docstring), then
    re-synchronise the model copy. With ``load_optimizer`` the optimizer state of every
    master becomes exactly what the shards give (moments missing for a box stay zero; a
    master holding only padding, which no box reaches, gets an empty state: its
    gradient is zero, so it never moves); otherwise it is left alone. If ``read`` or a write fails on any rank, every rank
    raises :class:`ShardedStateError` (what was written so far stays written)."""
    parts = _parts(engine)
    with _resident(parts, writeback=True):
        err = None
        try:
            _fill(parts, read, load_optimizer)
        except Exception as e:  # noqa: BLE001 - every rank must learn of any rank's failure
            err = f"{type(e).__name__}: {e}"
        first = first_error(parts.agree, None if err is None else f"{parts.rank}\0{err}")
        if first is not None:
            rank, _, msg = first.partition("\0")
            raise ShardedStateError(msg, int(rank))
        _sync_model(parts)
    if skipped_steps is not None:
        parts.zopt.skipped_steps = skipped_steps
    if loss_scaler is not None and parts.scaler is not None:
        parts.scaler.load_state_dict(loss_scaler)


def _fill(parts: _Parts, read: Reader, load_optimizer: bool) -> None:
    """Write every held box (no communication)."""
    opt = parts.zopt.optimizer
    states: dict[int, dict[str, Any]] = {}  # id(master) -> its new optimizer state
    with torch.no_grad():
        for t in _targets(parts, owned=False):
            shard = read(t.info, t.box)
            _check(shard, t)
            t.values.copy_(shard.master)
            if t.master is None or not load_optimizer:
                continue
            st = states.setdefault(id(t.master), {})
            for k, v in shard.moments.items():
                if k not in st:
                    st[k] = torch.zeros_like(t.master, dtype=torch.float32)  # padding stays zero
                _view(st[k], t).copy_(v)
            for k, v in shard.scalars.items():
                if k in st and float(st[k]) != float(v):
                    raise ValueError(f"{t.info.name}: optimizer scalar {k!r} is {float(v)} here and "
                                     f"{float(st[k])} for another parameter of the same flat unit")
                st[k] = v.clone() if isinstance(v, torch.Tensor) else v
    if load_optimizer:
        for m in parts.zopt.masters:
            opt.state[m] = states.get(id(m), {})


def _check(shard: ParamShard, t: _Target) -> None:
    if not isinstance(shard, ParamShard) or shard.box != t.box or shard.info.name != t.info.name:
        raise ValueError(f"{t.info.name}: asked for box {t.box}, got {getattr(shard, 'box', shard)!r}")
    want = box_shape(t.box)
    for k, v in [("master", shard.master), *shard.moments.items()]:
        if tuple(v.shape) != want:
            raise ValueError(f"{t.info.name} box {t.box}: {k} has shape {tuple(v.shape)}, expected {want}")


def _sync_model(parts: _Parts) -> None:
    """Push the masters into the model (all-gathers for stages 1–2, persistent units at
    stage 3), without counting the traffic as training communication."""
    stats = parts.comm.stats
    saved = (copy.deepcopy(stats.step), copy.deepcopy(stats.total))
    with torch.no_grad():
        parts.zopt.write_back()
        if parts.coordinator is not None:
            parts.coordinator.refresh_persistent(frozen_too=True)
    stats.step, stats.total = saved


def set_full_values(engine: Any, values: dict[str, torch.Tensor]) -> None:
    """Overwrite the named parameters with full values (every rank passes the same ones):
    every box this rank holds of them, masters included, then the model copy is
    re-synchronised. Parameters not named keep their state. All ranks call it."""
    parts = _parts(engine)
    with _resident(parts, writeback=True):
        with torch.no_grad():
            for t in _targets(parts, owned=False):
                v = values.get(t.info.name)
                if v is not None:
                    t.values.copy_(v[index(t.box)].to(t.values.dtype))
        _sync_model(parts)
