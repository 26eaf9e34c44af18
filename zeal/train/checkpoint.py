"""Save and load the complete training state, at any world size and any ZeRO stage.

Layout of ``<dir>/<tag>/`` (committed atomically, see :mod:`checkpoint_io`)::

    manifest.json            SHA-256 + size of every file, world size, commit sequence
    meta.json                counters, stage, optimizer hyper-parameters, LR schedule,
                             loss scaler, client state, model class/config, names/shapes
    rank00000.safetensors    what rank 0 owns, plus frozen parameters and buffers
    rank00001.safetensors    ...

Every rank writes its own file in parallel. For each unit it holds the flat range
``[start, end)`` of the stage-1 partition (stage 0 uses the same split so that the
writing is shared), and stores, *per parameter by name*, the 1-D slice of that
parameter inside the range: ``param/<name>`` (the fp32 master), ``optim.<key>/<name>``
(optimizer moments), with the slice's ``[lo, hi)`` inside the flattened parameter in
the file's JSON metadata (``pieces``), together with scalar optimizer state (Adam's
step) and this rank's RNG states. Loading needs no conversion step: each rank asks
whichever saved files cover them for exactly the pieces of each parameter its own
(new) shard needs (``safe_open(...).get_slice``), then writes them into the masters,
shards and optimizer state and pushes the masters into the model.

Communication: a handful of small all-gathers of strings (tag, file checksums, error
messages) on the engine's process group, plus the usual parameter all-gather of the
write-back after a load. All ranks must call :func:`save` / :func:`load`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from zeal.dist.comm import all_gather_flat
from zeal.train import checkpoint_io as cio
from zeal.train.checkpoint_io import CheckpointCorruptError, CheckpointError, TensorSpec
from zeal.train.checkpoint_state import join_client, rng_state, set_rng_state, split_client
from zeal.zero.partition import slot_overlap

log = logging.getLogger("zeal")
META = "meta.json"


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


# -- small collectives (strings, on the engine's group) --------------------------------------
def _gather_str(comm: Any, s: str, width: int = 8192) -> list[str]:
    if not comm.active:
        return [s]
    data = s.encode()[:width]
    buf = torch.zeros(width, dtype=torch.uint8)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
    out = torch.zeros(width * comm.size, dtype=torch.uint8)
    all_gather_flat(out, buf, group=comm.group)
    return [bytes(out[i * width:(i + 1) * width].tolist()).rstrip(b"\0").decode(errors="replace")
            for i in range(comm.size)]


def _agree(comm: Any, err: str | None) -> str | None:
    """Every rank learns the first error any rank had (in rank order); a barrier too."""
    errs = [e for e in _gather_str(comm, err or "") if e]
    return errs[0] if errs else None


# -- what a rank holds ------------------------------------------------------------------------
def _param_names(module: torch.nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for n, p in module.named_parameters():
        names.setdefault(id(p), n)
    return names


def _unit_sources(engine: Any):
    """(unit, source tensor, flat offset of the source inside the unit, master or None)
    for every unit; the source covers ``[base, base + numel)`` of the unit's flat buffer."""
    p = engine._p
    zopt = p.zero_optimizer
    master_of = {id(u): m for u, m in zip(zopt.units, zopt.masters)}
    for u in p.units:
        m = master_of.get(id(u))
        if m is not None:
            yield u, m.data, zopt.stage.owned_start(u), m
        else:
            yield u, u.shard, u.start, None


def _loose_params(engine: Any) -> list[tuple[str, torch.nn.Parameter]]:
    """Parameters outside flat units (frozen ones below stage 3)."""
    in_units = {id(q) for u in engine._p.units for q in u.params}
    return [(n, q) for n, q in engine.module.named_parameters() if id(q) not in in_units]


def _buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    keys = set(module.state_dict(keep_vars=True).keys())
    return [(n, b) for n, b in module.named_buffers() if n in keys]


def _scalar(v: Any) -> list:
    if isinstance(v, torch.Tensor):
        return [v.item(), str(v.dtype).removeprefix("torch.")]
    return [v, None]


def _unscalar(v: list) -> Any:
    return torch.tensor(v[0], dtype=getattr(torch, v[1])) if v[1] else v[0]


def _rank_specs(engine: Any) -> tuple[list[TensorSpec], dict]:
    """This rank's tensors (lazy 1-D slices) and the JSON index of its pieces."""
    specs: list[TensorSpec] = []
    pieces: dict[str, list[int]] = {}
    scalars: dict[str, dict] = {}
    opt_state = engine.optimizer.state

    def add(name: str, t: torch.Tensor) -> None:
        specs.append(TensorSpec(name, t.dtype, tuple(t.shape), lambda t=t: t))

    for u, src, base, m in _unit_sources(engine):
        state = opt_state.get(m, {}) if m is not None else {}
        for slot in u.slots:
            ov = slot_overlap(slot, u.start, u.end)
            if ov is None:
                continue
            a, b = slot.offset + ov[0] - base, slot.offset + ov[1] - base
            pieces[slot.name] = list(ov)
            add(f"param/{slot.name}", src[a:b])
            sc = {}
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.shape == m.shape:
                    add(f"optim.{k}/{slot.name}", v[a:b])
                elif isinstance(v, (int, float, bool)) or (isinstance(v, torch.Tensor) and v.dim() == 0):
                    sc[k] = _scalar(v)
                else:
                    raise CheckpointError(f"optimizer state {k!r} of {slot.name}: unsupported shape/type")
            if sc:
                scalars[slot.name] = sc
    if engine.rank == 0:
        for n, q in _loose_params(engine):
            pieces[n] = [0, q.numel()]
            add(f"param/{n}", q.data.reshape(-1))
        for n, b in _buffers(engine.module):
            add(f"buffer/{n}", b.data)
    return specs, {"pieces": pieces, "scalars": scalars}


def model_info(module: torch.nn.Module) -> dict:
    """Class and JSON config of the model (what export needs)."""
    cfg = getattr(module, "config", None)
    d = None
    if cfg is not None and hasattr(cfg, "to_dict"):
        d = cfg.to_dict()
    elif cfg is not None and dataclasses.is_dataclass(cfg):
        d = dataclasses.asdict(cfg)
    if d is not None:
        d = json.loads(json.dumps(d, default=str))
    cls = type(module)
    return {"class": f"{cls.__module__}.{cls.__qualname__}", "config": d}


def _meta(engine: Any, tag: str, client: Any) -> dict:
    p = engine._p
    zopt = p.zero_optimizer
    names = _param_names(engine.module)
    params = {}
    for u in p.units:
        dt = "float32" if u.trainable else str(u.dtype).removeprefix("torch.")
        for slot in u.slots:
            params[slot.name] = {"shape": list(slot.shape), "trainable": u.trainable, "group": u.group, "dtype": dt}
    for n, q in _loose_params(engine):
        params[n] = {"shape": list(q.shape), "trainable": False, "group": None,
                     "dtype": str(q.dtype).removeprefix("torch.")}
    bufs = {n: {"shape": list(b.shape), "dtype": str(b.dtype).removeprefix("torch.")}
            for n, b in _buffers(engine.module)}
    keys = set(engine.module.state_dict(keep_vars=True).keys())
    sd_keys = {n: ["param", names[id(q)]] for n, q in engine.module.named_parameters(remove_duplicate=False)
               if n in keys}
    sd_keys.update({n: ["buffer", n] for n in bufs})
    opt = engine.optimizer
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    state_keys = sorted({k for m in zopt.masters for k in opt.state.get(m, {})})
    sched = engine.lr_scheduler
    return {
        "tag": tag, "world_size": engine.world_size, "zero_stage": engine.zero_stage,
        "compute_dtype": str(p.compute_dtype).removeprefix("torch."),
        "global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
        "global_samples": engine.global_samples, "skipped_steps": zopt.skipped_steps,
        "params": params, "buffers": bufs, "state_dict_keys": sd_keys,
        "optimizer": {"class": type(opt).__name__, "param_groups": json.loads(json.dumps(groups, default=str)),
                      "state_keys": state_keys},
        "lr_scheduler": sched.state_dict() if sched is not None and hasattr(sched, "state_dict") else None,
        "loss_scaler": p.scaler.state_dict() if p.scaler is not None else None,
        "client_state": client, "model": model_info(engine.module),
        "files": [rank_file(r) for r in range(engine.world_size)],
    }


# -- save ---------------------------------------------------------------------------------------
def _in_memory(engine: Any, writeback: bool):
    """State kept on disk by ZeRO-Infinity, present in memory for the duration of a save/load."""
    from zeal.zero.offload_view import in_memory

    p = engine._p
    home = p.coordinator.coll.home if p.coordinator is not None else None
    return in_memory(p.zero_optimizer, home, p.units, writeback)


def save(engine: Any, save_dir: str, tag: str | None = None, client_state: dict | None = None) -> str:
    """Write a committed checkpoint ``save_dir/tag`` (default tag ``global_step<N>``);
    returns its path. On any rank's failure every rank raises and the previous
    checkpoints are untouched."""
    with _in_memory(engine, writeback=False):
        return _save(engine, save_dir, tag, client_state)


def _save(engine: Any, save_dir: str, tag: str | None = None, client_state: dict | None = None) -> str:
    comm, rank = engine._p.comm, engine.rank
    root = Path(save_dir)
    tag = cio.check_tag(tag if tag is not None else f"global_step{engine.global_steps}")
    if len(set(_gather_str(comm, tag))) != 1:
        raise CheckpointError(f"ranks disagree on the checkpoint tag: {sorted(set(_gather_str(comm, tag)))}")
    tmp = cio.tmp_dir(root, tag)
    err = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if (root / tag).exists():
                raise CheckpointError(f"{root / tag} already exists; choose another tag or delete it")
            cio.remove_stale(root)
            tmp.mkdir()
        except (OSError, CheckpointError) as e:
            err = str(e)
    err = _agree(comm, err)
    if err:
        raise CheckpointError(err)

    client_tensors: list[TensorSpec] = []
    report = ""
    try:
        client = split_client(client_state or {}, client_tensors)
        specs, index = _rank_specs(engine)
        if rank == 0:
            specs += client_tensors
        index.update(rank=rank, world_size=engine.world_size, rng=rng_state())
        sha, size = cio.write_safetensors(tmp / rank_file(rank), specs, {"zeal": json.dumps(index)})
        report = json.dumps([rank_file(rank), sha, size])
    except (OSError, CheckpointError, RuntimeError) as e:
        report = f"ERROR rank {rank}: {type(e).__name__}: {e}"
    reports = _gather_str(comm, report)
    err = next((r for r in reports if r.startswith("ERROR")), None)
    if err is None and rank == 0:
        try:
            files = {f: (s, n) for f, s, n in map(json.loads, reports)}
            files[META] = cio.write_json(tmp / META, _meta(engine, tag, client))
            cio.commit(root, tag, files, {"world_size": engine.world_size, "zero_stage": engine.zero_stage,
                                          "global_steps": engine.global_steps})
            keep = engine.config.checkpoint.keep_last
            if keep:
                cio.prune(root, keep, protect=[tag])
        except (OSError, CheckpointError) as e:
            err = f"rank 0: {type(e).__name__}: {e}"
    err = _agree(comm, err)
    if err:
        if rank == 0:
            cio.remove_tree(tmp)
        raise CheckpointError(f"saving checkpoint {tag!r} failed: {err}")
    return str(root / tag)


# -- load ---------------------------------------------------------------------------------------
class _Pieces:
    """Index of the saved pieces: key -> [(reader, lo, hi, path)], plus per-file metadata.
    ``transient``: map a file only while one tensor is read from it (export keeps its
    resident memory near one tensor instead of the whole mapped checkpoint)."""

    def __init__(self, folder: Path, files: list[str], transient: bool = False) -> None:
        self.transient = transient
        self.readers, self.meta, self.index = [], [], {}
        self.scalars: dict[str, dict] = {}
        for f in files:
            try:
                r = safe_open(str(folder / f), framework="pt")
                md = json.loads((r.metadata() or {})["zeal"])
                keys = list(r.keys())
            except Exception as e:  # noqa: BLE001 - any parse failure is a corrupt file
                raise CheckpointCorruptError(f"{folder / f}: not a readable safetensors shard ({e})") from None
            if md.get("rank") != len(self.readers) or md.get("world_size") != len(files):
                raise CheckpointCorruptError(f"{folder / f}: holds the shard of rank {md.get('rank')} of "
                                             f"{md.get('world_size')}, expected rank {len(self.readers)} of {len(files)}")
            self.readers.append(None if transient else r)
            self.meta.append(md)
            r = len(self.readers) - 1
            self.scalars.update(md.get("scalars", {}))
            for k in keys:
                kind, _, name = k.partition("/")
                if kind in ("param",) or kind.startswith("optim."):
                    lo, hi = md["pieces"][name]
                    self.index.setdefault(k, []).append((r, lo, hi, folder / f))
                else:
                    self.index.setdefault(k, []).append((r, None, None, folder / f))

    def read(self, key: str, lo: int, hi: int, out: torch.Tensor) -> None:
        """Fill ``out`` (1-D, hi-lo elements) with elements [lo, hi) of ``key``."""
        filled = 0
        for r, plo, phi, path in self.index.get(key, []):
            a, b = max(lo, plo), min(hi, phi)
            if a >= b:
                continue
            part = self._open(r, path).get_slice(key)[a - plo:b - plo]
            if part.numel() != b - a:
                raise CheckpointCorruptError(f"{path}: {key} has {part.numel()} elements, index says {b - a}")
            out[a - lo:b - lo].copy_(part)
            filled += b - a
        if filled != hi - lo:
            raise CheckpointCorruptError(f"{key}: saved pieces cover {filled} of the {hi - lo} elements "
                                         f"[{lo}, {hi}) needed")

    def whole(self, key: str) -> torch.Tensor:
        entries = self.index.get(key)
        if not entries:
            raise CheckpointCorruptError(f"{key}: not found in any shard")
        return self._open(entries[0][0], entries[0][3]).get_tensor(key)

    def _open(self, i: int, path: Path) -> Any:
        return self.readers[i] or safe_open(str(path), framework="pt")


def _verify(folder: Path, rank: int, world: int) -> dict:
    """Manifest check plus this rank's share of the file checksums; returns meta.json."""
    manifest = cio.read_manifest(folder)
    names = sorted(manifest["files"])
    saved_world = manifest.get("world_size")
    expected = [META] + [rank_file(r) for r in range(saved_world if isinstance(saved_world, int) else 0)]
    missing = [f for f in expected if f not in manifest["files"]]
    if missing:
        raise CheckpointCorruptError(f"{folder / MANIFEST_NAME}: does not list {missing[0]}")
    for i, f in enumerate(names):
        if i % world == rank or f == META:
            cio.verify_file(folder, f, manifest)
    return manifest


MANIFEST_NAME = cio.MANIFEST


def _read_meta(folder: Path) -> dict:
    try:
        meta = json.loads((folder / META).read_bytes())
        for key in ("files", "params", "buffers", "optimizer", "global_steps"):
            meta[key]
        return meta
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(f"{folder / META}: unreadable ({type(e).__name__}: {e})") from None


def _check_model(meta: dict, engine: Any) -> None:
    want = {n: list(q.shape) for n, q in engine.module.named_parameters()}
    have = {n: v["shape"] for n, v in meta["params"].items()}
    if want != have:
        miss = sorted(set(want) - set(have))
        extra = sorted(set(have) - set(want))
        diff = sorted(n for n in set(want) & set(have) if want[n] != have[n])
        raise CheckpointError(
            "checkpoint does not match the model: "
            + "; ".join(s for s in [f"missing {miss[:5]}" if miss else "", f"unexpected {extra[:5]}" if extra else "",
                                    ", ".join(f"{n}: saved {have[n]} vs model {want[n]}" for n in diff[:5])] if s))


def _read_into_engine(engine: Any, pieces: _Pieces, meta: dict, with_optim: bool) -> dict | None:
    """Phase without collectives: fill masters, shards, frozen params, buffers, optimizer state;
    returns this rank's saved RNG state (None when the saving job had fewer ranks)."""
    opt = engine.optimizer
    with torch.no_grad():
        for u, src, base, m in _unit_sources(engine):
            lo_u, hi_u = base, base + src.numel()
            state = {k: torch.zeros_like(m) for k in meta["optimizer"]["state_keys"]} if with_optim and m is not None else {}
            for slot in u.slots:
                ov = slot_overlap(slot, lo_u, hi_u)
                if ov is None:
                    continue
                a, b = slot.offset + ov[0] - base, slot.offset + ov[1] - base
                pieces.read(f"param/{slot.name}", ov[0], ov[1], src[a:b])
                for k in list(state):
                    if f"optim.{k}/{slot.name}" in pieces.index:
                        pieces.read(f"optim.{k}/{slot.name}", ov[0], ov[1], state[k][a:b])
            if m is not None and with_optim:
                sc = next((pieces.scalars[s.name] for s in u.slots if s.name in pieces.scalars), {})
                for k in list(state):
                    if k in sc:
                        state[k] = _unscalar(sc[k])
                    elif not any(f"optim.{k}/{s.name}" in pieces.index for s in u.slots):
                        del state[k]
                opt.state[m] = state
        for n, q in _loose_params(engine):
            flat = torch.empty(q.numel(), dtype=torch.float32 if q.dtype.is_floating_point else q.dtype)
            pieces.read(f"param/{n}", 0, q.numel(), flat)
            q.data.copy_(flat.view(q.shape))
        for n, b in _buffers(engine.module):
            if n in meta["buffers"]:
                b.copy_(pieces.whole(f"buffer/{n}"))
    return next((md["rng"] for md in pieces.meta if md.get("rank") == engine.rank), None)


def load(engine: Any, load_dir: str, tag: str | None = None, load_optimizer_states: bool = True,
         load_lr_scheduler_states: bool = True, load_module_only: bool = False) -> dict:
    """Load ``load_dir/tag`` (default: the newest committed tag) into the engine; returns
    the client state (see :func:`_load`)."""
    with _in_memory(engine, writeback=True):
        return _load(engine, load_dir, tag, load_optimizer_states, load_lr_scheduler_states, load_module_only)


def _load(engine: Any, load_dir: str, tag: str | None = None, load_optimizer_states: bool = True,
          load_lr_scheduler_states: bool = True, load_module_only: bool = False) -> dict:
    """Load ``load_dir/tag`` (default: the newest committed tag) into the engine; returns
    the client state. Raises :class:`CheckpointError` (or its subclass
    :class:`CheckpointCorruptError`) naming the file and the reason; with
    ``config.checkpoint.fallback_to_previous`` an unusable newest tag falls back to the
    previous committed one (only when no tag was named)."""
    comm, rank, world = engine._p.comm, engine.rank, engine.world_size
    root = Path(load_dir)
    candidates = cio.resolve_tags(root, tag)
    fallback = tag is None and engine.config.checkpoint.fallback_to_previous
    meta = pieces = None
    for i, t in enumerate(candidates):
        err = None
        try:
            _verify(root / t, rank, world)
            meta = _read_meta(root / t)
            _check_model(meta, engine)
            pieces = _Pieces(root / t, meta["files"])
        except CheckpointError as e:
            err = str(e)
        except (OSError, ValueError, KeyError, TypeError) as e:
            err = f"{root / t}: unreadable ({type(e).__name__}: {e})"
        err = _agree(comm, err)
        if err is None:
            tag = t
            break
        if not fallback or i == len(candidates) - 1 or "does not match the model" in err:
            raise (CheckpointError if "does not match the model" in err else CheckpointCorruptError)(err)
        log.warning("checkpoint %s is unusable (%s); falling back to %s", t, err, candidates[i + 1])
    folder = root / tag
    with_optim = load_optimizer_states and not load_module_only
    err, rng = None, None
    try:
        rng = _read_into_engine(engine, pieces, meta, with_optim)
    except CheckpointError as e:
        err = str(e)
    except Exception as e:  # noqa: BLE001 - report any rank's failure on every rank
        err = f"{folder}: {type(e).__name__}: {e}"
    err = _agree(comm, err)
    if err:
        raise CheckpointCorruptError(err)
    _write_back(engine)
    if load_module_only:
        return {}
    p = engine._p
    if with_optim:
        saved = meta["optimizer"]["param_groups"]
        if len(saved) != len(engine.optimizer.param_groups):
            raise CheckpointError(f"{folder / META}: {len(saved)} optimizer param groups saved, "
                                  f"{len(engine.optimizer.param_groups)} in the engine")
        for g, s in zip(engine.optimizer.param_groups, saved):
            for k, v in s.items():
                g[k] = tuple(v) if isinstance(g.get(k), tuple) else v
    if load_lr_scheduler_states and meta["lr_scheduler"] is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    if p.scaler is not None and meta["loss_scaler"] is not None:
        p.scaler.load_state_dict(meta["loss_scaler"])
    engine.global_steps, engine.micro_steps = meta["global_steps"], meta["micro_steps"]
    engine.global_samples = meta["global_samples"]
    p.zero_optimizer.skipped_steps = meta["skipped_steps"]
    if rng is not None:
        set_rng_state(rng)
    return join_client(meta["client_state"], _ClientReader(pieces))


class _ClientReader:
    def __init__(self, pieces: _Pieces) -> None:
        self.pieces = pieces

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.pieces.whole(key)


def _write_back(engine: Any) -> None:
    """Push masters into the model (all-gathers for stages 1–3), without counting the
    traffic as training communication."""
    p = engine._p
    stats = (copy.deepcopy(p.comm.stats.step), copy.deepcopy(p.comm.stats.total))
    with torch.no_grad():
        p.zero_optimizer.write_back()
        if p.coordinator is not None:
            p.coordinator.refresh_persistent(frozen_too=True)
    p.comm.stats.step, p.comm.stats.total = stats
