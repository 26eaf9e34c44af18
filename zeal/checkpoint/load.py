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
from pathlib import Path
from typing import Any

import torch

from zeal.checkpoint import files as cf
from zeal.checkpoint.extra_state import join_client, set_rng_state
from zeal.checkpoint.files import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from zeal.checkpoint.reader import SavedShards
from zeal.checkpoint.save import META, rank_file
from zeal.dist.agree import first_error
from zeal.zero.sharded_state import ParamInfo, ParamShard, ShardedStateError, dp_comm
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
    """meta.json, with the keys every reader needs present."""
    try:
        meta = json.loads((folder / META).read_bytes())
        for key in ("files", "params", "buffers", "optimizer", "global_steps"):
            meta[key]
        return meta
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(f"{folder / META}: unreadable ({type(e).__name__}: {e})") from None


def open_shards(folder: Path, manifest: dict, meta: dict, transient: bool = False) -> SavedShards:
    """The index of the saved boxes of a verified tag folder."""
    shapes = {n: v["shape"] for n, v in meta["params"].items()}
    return SavedShards(folder, meta["files"], shapes, manifest["version"], transient=transient)


def _check_model(meta: dict, module: torch.nn.Module) -> None:
    want = {n: list(q.shape) for n, q in module.named_parameters()}
    have = {n: v["shape"] for n, v in meta["params"].items()}
    if want != have:
        miss = sorted(set(want) - set(have))
        extra = sorted(set(have) - set(want))
        diff = sorted(n for n in set(want) & set(have) if want[n] != have[n])
        raise CheckpointMismatchError(
            "checkpoint does not match the model: "
            + "; ".join(s for s in [f"missing {miss[:5]}" if miss else "", f"unexpected {extra[:5]}" if extra else "",
                                    ", ".join(f"{n}: saved {have[n]} vs model {want[n]}" for n in diff[:5])] if s))


def _unscalar(v: list) -> Any:
    return torch.tensor(v[0], dtype=getattr(torch, v[1])) if v[1] else v[0]


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
            scalars = {k: _unscalar(v) for k, v in shards.scalars.get(info.name, {}).items()}
        return ParamShard(info, box, master, moments, scalars)

    return read


def _open(engine: Any, root: Path, tag: str | None) -> tuple[str, dict, SavedShards]:
    """The tag to load (falling back to older ones when configured), its meta and index."""
    comm, rank, world = dp_comm(engine), engine.rank, engine.world_size
    candidates = cf.resolve_tags(root, tag)
    fallback = tag is None and engine.config.checkpoint.fallback_to_previous
    for i, t in enumerate(candidates):
        err = meta = shards = None
        try:
            manifest = _verify(root / t, rank, world)
            meta = read_meta(root / t)
            _check_model(meta, engine.module)
            shards = open_shards(root / t, manifest, meta)
        except CheckpointError as e:
            err = e
        except (OSError, ValueError, KeyError, TypeError) as e:
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
    for a checkpoint of another model)."""
    root = Path(load_dir)
    tag, meta, shards = _open(engine, root, tag)
    folder = root / tag
    with_optim = load_optimizer_states and not load_module_only
    buffers, err = {}, None
    try:  # buffers are replicated: every rank reads them (before anything is written)
        buffers = {n: shards.whole(f"buffer/{n}") for n, _ in engine.module.named_buffers() if n in meta["buffers"]}
    except CheckpointError as e:
        err = e
    err = _agree(dp_comm(engine), err)
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
            if n in buffers:
                b.copy_(buffers[n])
    if load_module_only:
        return {}
    if with_optim:
        _load_param_groups(engine.optimizer, meta, folder)
    if load_lr_scheduler_states and meta["lr_scheduler"] is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    engine.global_steps, engine.micro_steps = meta["global_steps"], meta["micro_steps"]
    engine.global_samples = meta["global_samples"]
    rng = shards.rng(engine.rank)
    if rng is not None:
        set_rng_state(rng)
    return join_client(meta["client_state"], shards.whole)


def _load_param_groups(opt: Any, meta: dict, folder: Path) -> None:
    saved = meta["optimizer"]["param_groups"]
    if len(saved) != len(opt.param_groups):
        raise CheckpointError(f"{folder / META}: {len(saved)} optimizer param groups saved, "
                              f"{len(opt.param_groups)} in the engine")
    for g, s in zip(opt.param_groups, saved):
        for k, v in s.items():
            g[k] = tuple(v) if isinstance(g.get(k), tuple) else v
