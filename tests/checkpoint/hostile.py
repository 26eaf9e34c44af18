"""Helpers of the hostile-checkpoint tests: a tiny world-size-1 engine, a snapshot of
everything a load restores, an attacker's re-signing of a manifest, and a watch on
every file the process opens (Python's ``open`` through an audit hook, safetensors'
Rust ``safe_open`` through a wrapper)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import torch

from tests.checkpoint.test_resume_reshard import config, rank_state, train
from tests.train.models import TinyNet
from zeal.checkpoint import files as cio
from zeal.checkpoint import reader

_WATCHED: list[tuple[str, list[str]]] = []  # (folder prefix, paths opened under it)


def _audit(event: str, args: tuple) -> None:
    if event != "open" or not _WATCHED or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    path = os.path.realpath(os.fsdecode(args[0]))
    for prefix, hits in _WATCHED:
        if path == prefix.rstrip(os.sep) or path.startswith(prefix):
            hits.append(path)


sys.addaudithook(_audit)  # cannot be removed; inert while nothing is watched


@contextlib.contextmanager
def watch_opens(folder: Path, monkeypatch):
    """Record every file opened under ``folder`` (by Python or by safetensors)."""
    prefix = os.path.realpath(folder) + os.sep
    hits: list[str] = []
    real = reader.safe_open

    def safe_open(path, *a, **k):
        _audit("open", (path,))
        return real(path, *a, **k)

    monkeypatch.setattr(reader, "safe_open", safe_open)
    _WATCHED.append((prefix, hits))
    try:
        yield hits
    finally:
        _WATCHED.remove((prefix, hits))
        monkeypatch.setattr(reader, "safe_open", real)


def engine(seed: int = 5, **extra):
    import zeal

    torch.manual_seed(seed)
    return zeal.initialize(TinyNet(), config(1, **extra))


def save_two(root: Path) -> None:
    """``old`` after 2 steps, ``new`` after 3 (client state with a tensor)."""
    e = engine(0)
    train(e, 0, 1, range(0, 2))
    e.save_checkpoint(str(root), tag="old", client_state={"step": 2, "t": torch.arange(3)})
    train(e, 0, 1, range(2, 3))
    e.save_checkpoint(str(root), tag="new", client_state={"step": 3, "t": torch.arange(4)})


def snapshot(e, client) -> dict:
    """Everything a load restores (model, masters, optimizer, lr, counters, RNG, client)."""
    return {**rank_state(e), "rng": torch.get_rng_state(), "client": client}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def resign(folder: Path) -> None:
    """Recompute the manifest as an attacker with write access would (entries whose file
    is missing are left as they are)."""
    m = json.loads((folder / cio.MANIFEST).read_text())
    for name in m.get("files", {}):
        p = folder / name
        if p.is_file():
            sha, size = cio.file_sha256(p)
            m["files"][name] = {"sha256": sha, "bytes": size}
    body = {k: v for k, v in m.items() if k != "manifest_sha256"}
    m["manifest_sha256"] = cio._manifest_digest(body)
    (folder / cio.MANIFEST).write_text(json.dumps(m))


def edit_json(path: Path, fn) -> None:
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))
