"""Load a checkpoint at any world size and any ZeRO stage, over the sharded-state API.

Each rank verifies its share of the file checksums, indexes the saved boxes of every
parameter (:class:`~zeal.checkpoint.reader.SavedShards`), and hands
:func:`zeal.zero.sharded_state.load_sharded_state` a reader that, for each box this
rank holds under its own (new) layout, reads exactly the intersecting parts of the
saved boxes. Formats 1 (flat ranges) and 2 (N-d boxes) load alike.

Communication: small all-gathers of strings (errors) on the data-parallel group, plus
the parameter all-gathers of the re-synchronisation after the load. All ranks must call
:func:`load`.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zeal.checkpoint import files as cf
from zeal.checkpoint.extra_state import join_client, rng_problem, set_rng_state
from zeal.checkpoint.files import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from zeal.checkpoint.reader import SavedShards
from zeal.checkpoint.save import META, rank_file
from zeal.dist.agree import first_error
from zeal.zero.sharded_state import ParamInfo, ParamShard, ShardedStateError, param_infos, state_comm
from zeal.zero.slices import Box, box_shape

log = logging.getLogger("zeal")
_ERRORS = {"corrupt": CheckpointCorruptError, "mismatch": CheckpointMismatchError, "error": CheckpointError}


def _agree(comm: Any, err: CheckpointError | None) -> CheckpointError | None:
    """Every rank learns the first error (class and message) any rank had; a barrier too."""
    kind = next((k for k, cls in _ERRORS.items() if type(err) is cls), "error")
    first = first_error(comm, None if err is None else json.dumps([kind, str(err)]))
    if first is None:
        return None
    kind, msg = json.loads(first)
    return _ERRORS[kind](msg)


def _verify(folder: Path, rank: int, world: int) -> dict:
    """Manifest check plus this rank's share of the file checksums; returns the manifest."""
    manifest = cf.read_manifest(folder)
    saved_world = manifest.get("world_size")
    expected = [META] + [rank_file(r) for r in range(saved_world if isinstance(saved_world, int) else 0)]
    missing = [f for f in expected if f not in manifest["files"]]
    if missing:
        raise CheckpointCorruptError(f"{folder / cf.MANIFEST}: does not list {missing[0]}")
    for i, f in enumerate(sorted(manifest["files"])):
        if i % world == rank or f == META:
            cf.verify_file(folder, f, manifest)
    return manifest


def read_meta(folder: Path) -> dict:
    """meta.json, with the keys every reader needs present and of the right types."""
    path = folder / META
    try:
        meta = json.loads(path.read_bytes())
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(f"{path}: unreadable ({type(e).__name__}: {e})") from None
    bad = _meta_problem(meta)
    if bad:
        raise CheckpointCorruptError(f"{path}: {bad}")
    return meta


def _meta_problem(meta: Any) -> str | None:
    """What is malformed in meta.json (None when nothing is)."""
    if not isinstance(meta, dict):
        return "not a JSON object"
    for key in ("global_steps", "micro_steps", "global_samples", "skipped_steps"):
        if type(meta.get(key)) is not int or meta[key] < 0:
            return f"{key!r} is not a non-negative integer ({meta.get(key)!r:.60})"
    for key in ("params", "buffers"):
        entries = meta.get(key)
        if not isinstance(entries, dict) or not all(_tensor_entry(v) for v in entries.values()):
            return f"{key!r} is not a map of tensor entries (shape, dtype)"
    opt = meta.get("optimizer")
    if not isinstance(opt, dict) or not isinstance(opt.get("param_groups"), list) \
            or not all(isinstance(g, dict) for g in opt["param_groups"]):
        return "'optimizer.param_groups' is not a list of objects"
    for key in ("lr_scheduler", "loss_scaler"):
        if meta.get(key) is not None and not isinstance(meta[key], dict):
            return f"{key!r} is neither null nor an object"
    if not isinstance(meta.get("files"), list) or not isinstance(meta.get("state_dict_keys"), dict):
        return "'files' or 'state_dict_keys' malformed"
    return None


def _tensor_entry(v: Any) -> bool:
    return (isinstance(v, dict) and v.get("dtype") in cf.DTYPE_BY_NAME and isinstance(v.get("shape"), list)
            and all(type(d) is int and d >= 0 for d in v["shape"]))


def open_shards(folder: Path, manifest: dict, meta: dict, transient: bool = False) -> SavedShards:
    """The index of the saved boxes of a verified tag folder. The rank files it reads are
    exactly those of the manifest's world size (each listed, and so verified)."""
    expected = [rank_file(r) for r in range(manifest["world_size"])]
    if meta["files"] != expected or any(f not in manifest["files"] for f in expected):
        raise CheckpointCorruptError(f"{folder / META}: lists the files {meta['files']!r:.120}, expected "
                                     f"{expected!r:.120} as listed in {cf.MANIFEST}")
    shapes = {n: v["shape"] for n, v in meta["params"].items()}
    dtypes = {n: cf.DTYPE_BY_NAME[v["dtype"]] for n, v in meta["params"].items()}
    return SavedShards(folder, expected, shapes, manifest["version"], transient=transient, dtypes=dtypes)


def _check_model(meta: dict, whole: dict[str, ParamInfo], path: Path) -> None:
    """The saved parameters are the model's, each of the same *global* shape (a tensor-,
    pipeline- or expert-parallel engine compares the whole model's, never its shards)."""
    want = {n: list(i.shape) for n, i in whole.items()}
    have = {n: v["shape"] for n, v in meta["params"].items()}
    if want != have:
        miss = sorted(set(want) - set(have))
        extra = sorted(set(have) - set(want))
        diff = sorted(n for n in set(want) & set(have) if want[n] != have[n])
        raise CheckpointMismatchError(
            f"{path}: checkpoint does not match the model: "
            + "; ".join(s for s in [f"missing {miss[:5]}" if miss else "", f"unexpected {extra[:5]}" if extra else "",
                                    ", ".join(f"{n}: saved {have[n]} vs model {want[n]}" for n in diff[:5])] if s))


def _reader(shards: SavedShards, with_optim: bool):
    """``read(info, box)`` for :func:`load_sharded_state`: the box's master, and with
    ``with_optim`` every saved moment and scalar of that parameter."""

    def read(info: ParamInfo, box: Box) -> ParamShard:
        master = torch.empty(box_shape(box), dtype=info.dtype)
        shards.read("param", info.name, box, master)
        moments, scalars = {}, {}
        if with_optim and info.trainable:
            for kind in sorted(shards.kinds.get(info.name, ())):
                if kind.startswith("optim."):
                    moments[kind.removeprefix("optim.")] = t = torch.empty(box_shape(box), dtype=torch.float32)
                    shards.read(kind, info.name, box, t)
            scalars = shards.scalar_values(info.name)
        return ParamShard(info, box, master, moments, scalars)

    return read


def _open(engine: Any, root: Path, tag: str | None) -> tuple[str, dict, SavedShards]:
    """The tag to load (falling back to older ones when configured), its meta and index."""
    comm, rank, world = state_comm(engine), engine.rank, engine.world_size
    candidates = cf.resolve_tags(root, tag)
    fallback = tag is None and engine.config.checkpoint.fallback_to_previous
    for i, t in enumerate(candidates):
        err = meta = shards = None
        try:
            manifest = _verify(root / t, rank, world)
            meta = read_meta(root / t)
            _check_model(meta, param_infos(engine), root / t / META)
            shards = open_shards(root / t, manifest, meta)
        except CheckpointError as e:
            err = e
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, OverflowError) as e:
            err = CheckpointCorruptError(f"{root / t}: unreadable ({type(e).__name__}: {e})")
        err = _agree(comm, err)
        if err is None:
            return t, meta, shards
        if not fallback or i == len(candidates) - 1 or isinstance(err, CheckpointMismatchError):
            raise err
        log.warning("checkpoint %s is unusable (%s); falling back to %s", t, err, candidates[i + 1])
    raise CheckpointError(f"{root}: no checkpoint to load")  # resolve_tags never returns an empty list


def load(engine: Any, load_dir: str, tag: str | None = None, load_optimizer_states: bool = True,
         load_lr_scheduler_states: bool = True, load_module_only: bool = False) -> dict:
    """Load ``load_dir/tag`` (default: the newest committed tag) into the engine; returns
    the client state. Raises :class:`CheckpointError` (or its subclasses
    :class:`CheckpointCorruptError`, :class:`CheckpointMismatchError`) naming the file and
    the reason; with ``config.checkpoint.fallback_to_previous`` an unusable newest tag
    falls back to the previous committed one (only when no tag was named, and never
    for a checkpoint of another model). Everything but the parameter boxes is read and
    checked before the engine changes."""
    root = Path(load_dir)
    tag, meta, shards = _open(engine, root, tag)
    folder = root / tag
    with_optim = load_optimizer_states and not load_module_only
    prep, err = None, None
    try:
        prep = _prepare(engine, meta, shards, folder, with_optim, load_module_only)
    except CheckpointError as e:
        err = e
    err = _agree(state_comm(engine), err)
    if err is not None:
        raise err
    try:
        engine.load_sharded_state(_reader(shards, with_optim), load_optimizer=with_optim,
                                  skipped_steps=None if load_module_only else meta["skipped_steps"],
                                  loss_scaler=None if load_module_only else meta["loss_scaler"])
    except ShardedStateError as e:
        raise CheckpointCorruptError(f"{folder}: rank {e.rank}: {e}") from None
    with torch.no_grad():
        for n, b in engine.module.named_buffers():
            if n in prep.buffers:
                b.copy_(prep.buffers[n])
    if load_module_only:
        return {}
    for g, new in zip(engine.optimizer.param_groups, prep.groups or ()):
        g.update(new)
    if load_lr_scheduler_states and meta["lr_scheduler"] is not None and engine.lr_scheduler is not None:
        try:
            engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise CheckpointCorruptError(f"{folder / META}: 'lr_scheduler' unusable ({type(e).__name__}: {e})") \
                from None
    engine.restore_progress(meta["global_steps"], meta["micro_steps"], meta["global_samples"])
    if prep.rng is not None:
        set_rng_state(prep.rng)
    return prep.client


@dataclass
class _Prepared:
    """What a load reads besides the parameter boxes, checked before anything is written."""

    buffers: dict[str, torch.Tensor]
    groups: list[dict] | None
    rng: dict | None
    client: Any


def _prepare(engine: Any, meta: dict, shards: SavedShards, folder: Path, with_optim: bool,
             module_only: bool) -> _Prepared:
    buffers = {}  # replicated: every rank reads them
    for n, b in engine.module.named_buffers():
        if n in meta["buffers"]:
            buffers[n] = shards.whole(f"buffer/{n}", tuple(b.shape), cf.DTYPE_BY_NAME[meta["buffers"][n]["dtype"]])
    if module_only:
        return _Prepared(buffers, None, None, {})
    groups = _param_groups(engine.optimizer, meta, folder) if with_optim else None
    rng = shards.rng(engine.rank)
    bad = None if rng is None else rng_problem(rng)
    if bad:
        raise CheckpointCorruptError(f"{shards.path(engine.rank)}: saved RNG state malformed ({bad})")
    return _Prepared(buffers, groups, rng, join_client(meta["client_state"], shards.whole))


def _param_groups(opt: Any, meta: dict, folder: Path) -> list[dict]:
    """The saved hyper-parameters of every param group, each value checked against the
    type the engine's optimizer holds for that key."""
    saved = meta["optimizer"]["param_groups"]
    if len(saved) != len(opt.param_groups):
        raise CheckpointError(f"{folder / META}: {len(saved)} optimizer param groups saved, "
                              f"{len(opt.param_groups)} in the engine")
    out = []
    for i, (g, s) in enumerate(zip(opt.param_groups, saved)):
        new = {}
        for k, v in s.items():
            cur = g.get(k)
            if isinstance(cur, tuple):
                ok = isinstance(v, list) and len(v) == len(cur) and all(map(_finite, v))
                v = tuple(v) if ok else v
            elif isinstance(cur, bool):
                ok = isinstance(v, bool)
            elif _finite(cur) or isinstance(cur, torch.Tensor):
                ok = _finite(v)
            else:
                ok = v is None or isinstance(v, (bool, int, float, str))
            if not ok or k == "params":
                raise CheckpointCorruptError(f"{folder / META}: optimizer param group {i}: {k!r} = {v!r:.40} "
                                             f"does not fit the optimizer's {cur!r:.40}")
            new[k] = v
        out.append(new)
    return out


def _finite(x: Any) -> bool:
    try:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    except OverflowError:  # an int beyond float range
        return False
