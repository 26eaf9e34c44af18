"""Checkpoint files on disk: streaming safetensors writes, atomic commit, manifest, verify.

A checkpoint folder ``<dir>/<tag>/`` is *committed* when it holds ``manifest.json``;
it only gets that name by a rename of a fully written, fsynced temporary folder
``<dir>/.<tag>.tmp``, so a crash at any moment leaves either the old state or the
new one. The manifest lists SHA-256 and size of every file and carries a checksum
of itself, so that any edit is detected. ``<dir>/latest`` names the newest tag; it
is replaced atomically (write ``latest.tmp``, fsync, ``os.replace``, fsync the folder).

Tensors are written in the safetensors format by :func:`write_safetensors`, one
tensor at a time straight from its producer (no whole-file buffer), hashing the
bytes as they go. Reading always goes through the official ``safetensors`` parser.
Nothing here ever unpickles.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

FORMAT = "zeal-checkpoint"
# 1: per-rank flat [lo, hi) ranges of flattened parameters; 2: per-rank N-d boxes (see save.py).
VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
LATEST = "latest"
DAMAGED = 1 << 62
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")

DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded (missing, not committed, mismatched)."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file is missing, truncated, altered or not what the manifest says."""


class CheckpointMismatchError(CheckpointError):
    """A sound checkpoint of another model (parameter names or shapes differ)."""


# -- safetensors, streamed -------------------------------------------------------------------
@dataclass
class TensorSpec:
    """One tensor to write: its name, dtype and shape, and a callable producing it
    (called once, when its turn comes)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def write_safetensors(path: Path, specs: list[TensorSpec], metadata: dict[str, str] | None = None) -> tuple[str, int]:
    """Write a safetensors file tensor by tensor (peak extra memory: one tensor), fsync
    it, and return (sha256 hex, size in bytes)."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    off = 0
    for s in specs:
        if s.dtype not in DTYPES:
            raise CheckpointError(f"cannot store tensor {s.name!r} of dtype {s.dtype}")
        header[s.name] = {"dtype": DTYPES[s.dtype], "shape": list(s.shape), "data_offsets": [off, off + s.nbytes]}
        off += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    h = hashlib.sha256()
    size = 0
    with open(path, "wb") as f:
        def put(b) -> None:
            nonlocal size
            h.update(b)
            f.write(b)
            size += len(b) if isinstance(b, bytes) else b.nbytes

        put(len(raw).to_bytes(8, "little"))
        put(raw)
        for s in specs:
            t = s.produce().detach()
            if t.dtype != s.dtype or tuple(t.shape) != tuple(s.shape):
                raise CheckpointError(f"tensor {s.name!r}: produced {t.dtype} {tuple(t.shape)}, "
                                      f"announced {s.dtype} {s.shape}")
            if t.numel():
                put(memoryview(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())
    return h.hexdigest(), size


def file_sha256(path: Path, chunk: int = 1 << 22) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
            size += len(b)
    return h.hexdigest(), size


def write_json(path: Path, obj: object) -> tuple[str, int]:
    """Write JSON and fsync; returns (sha256, size)."""
    data = (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest(), len(data)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- tags, commit, manifest --------------------------------------------------------------------
def check_tag(tag: str) -> str:
    if not isinstance(tag, str) or not _TAG_RE.match(tag) or tag == LATEST or tag.endswith(".tmp"):
        raise CheckpointError(f"invalid checkpoint tag {tag!r} (letters, digits, '_', '-', '.'; "
                              f"not {LATEST!r}, not starting with '.')")
    return tag


def tmp_dir(root: Path, tag: str) -> Path:
    return root / f".{tag}.tmp"


def _manifest_digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def commit(root: Path, tag: str, files: dict[str, tuple[str, int]], info: dict) -> Path:
    """Rank 0, after every rank fsynced its files into ``.<tag>.tmp``: write the
    manifest, fsync, rename the folder into place, then move ``latest``."""
    tmp, final = tmp_dir(root, tag), root / tag
    body = {"format": FORMAT, "version": VERSION, "tag": tag, "seq": next_seq(root), **info,
            "files": {name: {"sha256": sha, "bytes": size} for name, (sha, size) in sorted(files.items())}}
    write_json(tmp / MANIFEST, {**body, "manifest_sha256": _manifest_digest(body)})
    fsync_dir(tmp)
    os.rename(tmp, final)
    fsync_dir(root)
    write_latest(root, tag)
    return final


def write_latest(root: Path, tag: str) -> None:
    tmp = root / (LATEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(tag + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    fsync_dir(root)


def read_manifest(folder: Path) -> dict:
    """The manifest of a committed folder, checked against its own checksum."""
    path = folder / MANIFEST
    if not path.is_file():
        raise CheckpointCorruptError(f"{path}: missing (the checkpoint was never committed)")
    try:
        m = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{path}: not a zeal checkpoint manifest")
    body = {k: v for k, v in m.items() if k != "manifest_sha256"}
    if m.get("manifest_sha256") != _manifest_digest(body):
        raise CheckpointCorruptError(f"{path}: manifest checksum mismatch (the manifest was edited or damaged)")
    if m.get("version") not in READABLE_VERSIONS:
        raise CheckpointCorruptError(f"{path}: unsupported format version {m.get('version')}")
    return m


def verify_file(folder: Path, name: str, manifest: dict) -> None:
    """Size and SHA-256 of one file against the manifest."""
    entry = manifest["files"].get(name)
    path = folder / name
    if entry is None:
        raise CheckpointCorruptError(f"{path}: not listed in the manifest")
    if not path.is_file():
        raise CheckpointCorruptError(f"{path}: missing")
    size = path.stat().st_size
    if size != entry["bytes"]:
        how = "truncated" if size < entry["bytes"] else "has extra bytes"
        raise CheckpointCorruptError(f"{path}: {how} ({size} bytes, manifest says {entry['bytes']})")
    sha, _ = file_sha256(path)
    if sha != entry["sha256"]:
        raise CheckpointCorruptError(f"{path}: SHA-256 mismatch (content altered)")


def committed_tags(root: Path) -> list[tuple[int, str]]:
    """(seq, tag) of every folder that has a manifest, newest first (damaged manifests first)."""
    out = []
    if not root.is_dir():
        return out
    for p in root.iterdir():
        if p.is_dir() and not p.name.startswith(".") and (p / MANIFEST).is_file():
            try:
                seq = int(read_manifest(p)["seq"])
            except (CheckpointError, KeyError, TypeError, ValueError):
                seq = DAMAGED  # never produced by a crash: tried first, so that loading it reports why
            out.append((seq, p.name))
    return sorted(out, reverse=True)


def next_seq(root: Path) -> int:
    return 1 + max((s for s, _ in committed_tags(root) if s != DAMAGED), default=0)


def resolve_tags(root: Path, tag: str | None) -> list[str]:
    """Tags to try in order: the named one, or the newest committed (the ``latest``
    pointer's target must be committed), then older ones (used only for fallback)."""
    if not root.exists():
        raise CheckpointError(f"{root}: no such checkpoint folder")
    if tag is not None:
        check_tag(tag)
        if not (root / tag).is_dir():
            raise CheckpointError(f"{root / tag}: no such checkpoint")
        return [tag]
    tags = [t for _, t in committed_tags(root)]
    latest = root / LATEST
    if latest.is_file():
        named = latest.read_text().strip()
        if named not in tags:
            # the pointer names a tag that is gone or was never committed: surface it first
            return [named] + tags
    if not tags:
        raise CheckpointError(f"{root}: no committed checkpoint (no <tag>/{MANIFEST}); refusing to start fresh")
    return tags


def remove_tree(path: Path) -> None:
    """Rename out of the way (atomic: never a half-deleted committed folder), then delete."""
    if not path.exists():
        return
    trash = path.parent / f".{path.name}.deleting"
    if trash.exists():
        shutil.rmtree(trash, ignore_errors=True)
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def remove_stale(root: Path) -> None:
    """Delete leftovers of interrupted saves and deletions (``.<tag>.tmp``, ``.<tag>.deleting``).
    One training job per checkpoint folder is assumed."""
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith(".") and p.name.endswith((".tmp", ".deleting")):
            shutil.rmtree(p, ignore_errors=True)


def prune(root: Path, keep_last: int, protect: Iterable[str] = ()) -> list[str]:
    """Delete committed checkpoints beyond the newest ``keep_last``; returns removed tags."""
    protect = set(protect)
    removed = []
    for _, t in committed_tags(root)[keep_last:]:
        if t not in protect:
            remove_tree(root / t)
            removed.append(t)
    if removed:
        fsync_dir(root)
    return removed
