"""One parameter's state, whole or this rank's part, read or written by name: the fp32
master, the mean gradient of the step being accumulated, or an optimizer moment.

Built on the sharded-state view (:mod:`zeal.zero.sharded_state`): the boxes a rank owns
tile every parameter once over the world, so a whole value is the sum over the world
of each rank's owned boxes placed in a zero tensor (one all-reduce of the parameter's
size, every rank calls it). A rank's *local* part is its owned boxes end to end in flat
order (zeal partitions flat units, so it is a range of the flattened parameter, not
DeepSpeed's per-parameter partition). Writes go to every box a rank holds (stage 0 holds
the whole master), then the model copy is re-synchronised from the masters.

``what`` is ``"fp32"`` (the master), ``"grad"`` (the reduced gradient of the step being
accumulated: valid after the backward of an accumulation boundary and before ``step``;
the mean over the data-parallel ranks with the fp16 loss scale taken out, as the
optimizer will see it before clipping) or the name of an optimizer state (``"exp_avg"``,
``"exp_avg_sq"``). Frozen parameters have no master, gradient or state: None."""

from __future__ import annotations

from typing import Any

import torch

from zeal.zero.sharded_state import _infos, _parts, _resident, _sync_model, _Target, _targets, _view
from zeal.zero.slices import index

__all__ = ["full_state", "local_state", "set_full_state", "set_local_state"]


def _source(parts: Any, t: _Target, what: str) -> torch.Tensor | None:
    """The live tensor holding ``what`` for target ``t`` (a view of the box), or None."""
    if t.master is None:
        return None
    if what == "fp32":
        return t.values
    if what == "grad":
        reducer = parts.zopt.reducer
        u = next(u for u, m in zip(parts.zopt.units, parts.zopt.masters) if m is t.master)
        flat = reducer.full_grads.get(u.index) if reducer.mode == "all_reduce" else reducer.acc.get(u.index)
        if flat is None:
            return None
        g = _view(flat, t).float() / max(reducer.world, 1)
        if parts.scaler is not None:
            g = g / parts.scaler.scale
        return g
    state = parts.zopt.optimizer.state.get(t.master, {})
    v = state.get(what)
    if not isinstance(v, torch.Tensor) or v.shape != t.master.shape:
        return None
    return _view(v, t)


def full_state(engine: Any, name: str, what: str = "fp32") -> torch.Tensor | None:
    """The whole ``what`` of parameter ``name`` (fp32, its global shape), the same on every
    rank; None for a frozen parameter or state not there yet. All ranks call it."""
    parts = _parts(engine)
    with _resident(parts, writeback=False):
        targets = [t for t in _targets(parts, owned=True) if t.info.name == name]
        info = targets[0].info if targets else engine_info(parts, name)
        out = torch.zeros(info.shape, dtype=torch.float32)
        found = torch.zeros(1)
        for t in targets:
            src = _source(parts, t, what)
            if src is not None:
                out[index(t.box)] = src.detach().float().cpu()
                found += 1
    if parts.agree is not None and parts.agree.active:
        parts.agree.all_reduce(out, "control")
        parts.agree.all_reduce(found, "control")
    return out if found.item() > 0 else None


def engine_info(parts: Any, name: str) -> Any:
    """The :class:`ParamInfo` of ``name`` (KeyError naming it when the model has none)."""
    infos = _infos(parts)
    if name not in infos:
        raise KeyError(f"no parameter named {name!r} in this engine's model")
    return infos[name]


def local_state(engine: Any, name: str, what: str = "fp32") -> torch.Tensor | None:
    """This rank's part of ``what`` of parameter ``name``: its owned boxes end to end
    (1-d, fp32; empty when it owns none). No communication."""
    parts = _parts(engine)
    with _resident(parts, writeback=False):
        engine_info(parts, name)
        pieces = []
        for t in _targets(parts, owned=True):
            if t.info.name != name:
                continue
            src = _source(parts, t, what)
            if src is None:
                return None
            pieces.append(src.detach().float().reshape(-1).cpu())
    return torch.cat(pieces) if pieces else torch.zeros(0)


def set_full_state(engine: Any, name: str, value: torch.Tensor, what: str = "fp32") -> None:
    """Set the whole ``what`` (``"fp32"`` or an optimizer state) of parameter ``name`` from
    ``value`` (its global shape; every rank passes the same); a new master is copied into
    the model. All ranks call it."""
    if what == "grad":
        raise ValueError("set_full_state: gradients are written by backward; scale the loss instead")
    parts = _parts(engine)
    info = engine_info(parts, name)
    if tuple(value.shape) != tuple(info.shape):
        raise ValueError(f"set_full_state({name!r}): value of shape {tuple(value.shape)}, the parameter's is "
                         f"{tuple(info.shape)}")
    with _resident(parts, writeback=True), torch.no_grad():
        for t in _targets(parts, owned=False):
            if t.info.name != name:
                continue
            dst = _source(parts, t, what)
            if dst is None:
                raise ValueError(f"set_full_state({name!r}, {what!r}): the parameter has no such state "
                                 "(frozen, or the optimizer has not stepped yet)")
            dst.copy_(value[index(t.box)].to(dst.dtype))
        if what == "fp32":
            _sync_model(parts)


def set_local_state(engine: Any, name: str, value: torch.Tensor, what: str = "fp32") -> None:
    """Set this rank's part of ``what`` of ``name`` (what :func:`local_state` returns, same
    length). Below stage 3 the masters a rank holds beyond its own part are not written,
    and the model copy is refreshed by the next step; all ranks call it at stage 3."""
    if what == "grad":
        raise ValueError("set_local_state: gradients are written by backward; scale the loss instead")
    parts = _parts(engine)
    engine_info(parts, name)
    flat = value.reshape(-1)
    at = 0
    with _resident(parts, writeback=True), torch.no_grad():
        for t in _targets(parts, owned=True):
            if t.info.name != name:
                continue
            dst = _source(parts, t, what)
            if dst is None:
                raise ValueError(f"set_local_state({name!r}, {what!r}): the parameter has no such state")
            n = dst.numel()
            dst.copy_(flat[at:at + n].view(dst.shape).to(dst.dtype))
            at += n
        if at != flat.numel():
            raise ValueError(f"set_local_state({name!r}): {flat.numel()} values for a local part of {at}")
        if what == "fp32":
            _sync_model(parts)
