"""Save the complete training state over the sharded-state API.

Layout of ``<dir>/<tag>/`` (format 2; committed atomically, see :mod:`zeal.checkpoint.files`)::

    manifest.json            format version, SHA-256 + size of every file, world size, commit sequence
    meta.json                counters, stage, optimizer hyper-parameters, LR schedule,
                             loss scaler, client state, model class/config, names/shapes
    rank00000.safetensors    what rank 0 owns, plus buffers and client tensors
    rank00001.safetensors    ...

Every rank writes its own file in parallel, streaming straight from the live state
(the shards of :func:`zeal.zero.sharded_state.sharded_state` are views): for every
box k it owns of parameter <name>, ``param/<name>/<k>`` (the master) and
``optim.<key>/<name>/<k>`` (each optimizer moment), stored with the box's N-d shape;
the file's JSON metadata lists the boxes, the scalar optimizer state (Adam's step) and
this rank's RNG states. See :mod:`zeal.checkpoint.reader` for how any box is read back.

Communication: a few small all-gathers of strings (tag, file checksums, errors) on
the data-parallel group (every rank of the world under tensor parallelism). All ranks must call :func:`save`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch

from zeal.checkpoint import files as cf
from zeal.checkpoint.extra_state import rng_state, split_client
from zeal.checkpoint.files import CheckpointError, TensorSpec
from zeal.dist.agree import first_error, gather_strings
from zeal.moe.layout import expand, expert_prefixes, writes_buffer
from zeal.zero.sharded_state import ShardedState, state_comm

META = "meta.json"
log = logging.getLogger("zeal")


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def scalar_to_json(v: Any) -> list:
    """[value, dtype name or None]: a 0-d tensor keeps its dtype."""
    if isinstance(v, torch.Tensor):
        return [v.item(), dtype_name(v.dtype)]
    return [v, None]


def _rank_specs(st: ShardedState, module: torch.nn.Module, writes: Any) -> tuple[list[TensorSpec], dict]:
    """This rank's tensors (lazy: each produced when written) and the JSON index of its boxes."""
    specs: list[TensorSpec] = []
    boxes: dict[str, list[list[list[int]]]] = {}
    scalars: dict[str, dict] = {}

    def add(key: str, t: torch.Tensor) -> None:
        specs.append(TensorSpec(key, t.dtype, tuple(t.shape), lambda t=t: t))

    for sh in st.shards:
        k = len(boxes.setdefault(sh.name, []))
        boxes[sh.name].append([list(r) for r in sh.box])
        add(f"param/{sh.name}/{k}", sh.master)
        for key, v in sorted(sh.moments.items()):
            add(f"optim.{key}/{sh.name}/{k}", v)
        if sh.scalars:
            scalars[sh.name] = {key: scalar_to_json(v) for key, v in sorted(sh.scalars.items())}
    for n, b in _buffers(module):
        if writes(n):  # rank 0; an MoE expert's buffer: the first rank holding that expert
            add(f"buffer/{n}", b.data)
    return specs, {"boxes": boxes, "scalars": scalars}


def _buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Buffers that belong to the state dict (not the non-persistent ones)."""
    keys = set(module.state_dict(keep_vars=True).keys())
    return [(n, b) for n, b in module.named_buffers() if n in keys]


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


def _meta(engine: Any, st: ShardedState, tag: str, client: Any) -> dict:
    module = engine.module
    params = {n: {"shape": list(p.shape), "trainable": p.trainable, "group": p.group, "dtype": dtype_name(p.dtype)}
              for n, p in st.params.items()}
    bufs = {n: {"shape": list(b.shape), "dtype": dtype_name(b.dtype)} for n, b in _buffers(module)}
    bufs = expand(bufs, expert_prefixes(module), lambda v, _: v)  # MoE: every expert's, not only this rank's
    keys = set(module.state_dict(keep_vars=True).keys())
    first_name: dict[int, str] = {}
    for n, q in module.named_parameters():
        first_name.setdefault(id(q), n)
    sd_keys = {n: ["param", first_name[id(q)]] for n, q in module.named_parameters(remove_duplicate=False)
               if n in keys}
    sd_keys = getattr(engine, "global_state_dict_keys", None) or sd_keys  # pipeline stages: the whole model's
    sd_keys.update({n: ["buffer", n] for n in bufs})
    opt = engine.optimizer
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    # rank 0 owns the first element of every flat unit, so its shards show every state key
    state_keys = sorted({k for sh in st.shards for k in (*sh.moments, *sh.scalars)})
    compute = next((p.model_dtype for p in st.params.values() if p.trainable), None)
    sched = engine.lr_scheduler
    return {
        "tag": tag, "world_size": st.world_size, "zero_stage": engine.zero_stage,
        "compute_dtype": dtype_name(compute) if compute is not None else None,
        "global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
        "global_samples": engine.global_samples, "skipped_steps": st.skipped_steps,
        "params": params, "buffers": bufs, "state_dict_keys": sd_keys,
        "optimizer": {"class": type(opt).__name__, "param_groups": json.loads(json.dumps(groups, default=str)),
                      "state_keys": state_keys},
        "lr_scheduler": sched.state_dict() if sched is not None and hasattr(sched, "state_dict") else None,
        "loss_scaler": st.loss_scaler, "client_state": client, "model": model_info(module),
        "files": [rank_file(r) for r in range(st.world_size)],
    }


def save(engine: Any, save_dir: str, tag: str | None = None, client_state: dict | None = None) -> str:
    """Write a committed checkpoint ``save_dir/tag`` (default tag ``global_step<N>``);
    returns its path. On any rank's failure every rank raises and the previous
    checkpoints are untouched."""
    comm, rank = state_comm(engine), engine.rank
    root = Path(save_dir)
    tag = cf.check_tag(tag if tag is not None else f"global_step{engine.global_steps}")
    tags = set(gather_strings(comm, tag))
    if len(tags) != 1:
        raise CheckpointError(f"ranks disagree on the checkpoint tag: {sorted(tags)}")
    tmp = cf.tmp_dir(root, tag)
    err = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if (root / tag).exists():
                raise CheckpointError(f"{root / tag} already exists; choose another tag or delete it")
            cf.remove_stale(root)
            tmp.mkdir()
        except (OSError, CheckpointError) as e:
            err = str(e)
    err = first_error(comm, err)
    if err:
        raise CheckpointError(err)
    with engine.sharded_state() as st:
        err = _write(engine, st, root, tmp, tag, client_state)
    if err:
        if rank == 0:
            cf.remove_tree(tmp)
        raise CheckpointError(f"saving checkpoint {tag!r} into {root / tag} failed: {err}")
    return str(root / tag)


def _write(engine: Any, st: ShardedState, root: Path, tmp: Path, tag: str, client_state: dict | None) -> str | None:
    """Every rank writes its file; rank 0 writes meta.json and commits. Returns the first
    error of any rank (the same on every rank), or None."""
    comm, rank = state_comm(engine), st.rank
    client_tensors: list[TensorSpec] = []
    client = None
    try:
        client = split_client(client_state or {}, client_tensors)
        prefixes = expert_prefixes(engine.module)
        specs, index = _rank_specs(st, engine.module, lambda n: writes_buffer(engine, n, prefixes))
        if rank == 0:
            specs += client_tensors
        index.update(rank=rank, world_size=st.world_size, rng=rng_state())
        sha, size = cf.write_safetensors(tmp / rank_file(rank), specs, {"zeal": json.dumps(index)})
        report = {"file": rank_file(rank), "sha256": sha, "bytes": size}
    except (OSError, CheckpointError, RuntimeError, ValueError) as e:
        report = {"error": f"rank {rank}: {type(e).__name__}: {e}"[:4000]}  # fits gather_strings
    reports = [json.loads(r) for r in gather_strings(comm, json.dumps(report))]
    err = next((r["error"] for r in reports if "error" in r), None)
    if err is None and rank == 0:
        try:
            written = {r["file"]: (r["sha256"], r["bytes"]) for r in reports}
            written[META] = cf.write_json(tmp / META, _meta(engine, st, tag, client))
            cf.commit(root, tag, written, {"world_size": st.world_size, "zero_stage": engine.zero_stage,
                                           "global_steps": engine.global_steps})
        except (OSError, CheckpointError) as e:
            err = f"rank 0: {type(e).__name__}: {e}"
        if err is None:
            _prune(root, tag, engine.config.checkpoint.keep_last)
    return first_error(comm, err)


def _prune(root: Path, tag: str, keep: int | None) -> None:
    """Retention after a commit: a failure only warns (the new checkpoint is committed,
    so the save must not raise)."""
    if not keep:
        return
    try:
        cf.prune(root, keep, protect=[tag])
    except OSError as e:
        log.warning("checkpoint %s committed; removing older checkpoints failed: %s", root / tag, e)
