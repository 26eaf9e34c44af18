"""Checkpoint files on disk: streaming safetensors writes, atomic commit, manifest, verify.

A checkpoint folder ``<dir>/<tag>/`` is *committed* when it holds ``manifest.json``;
it only gets that name by a rename of a fully written, fsynced temporary folder
``<dir>/.<tag>.tmp``, so a crash at any moment leaves either the old state or the
new one. The manifest lists SHA-256 and size of every file and carries a checksum
of itself, so that any edit is detected. ``<dir>/latest`` names the newest tag.

The commit (:func:`commit`) writes everything that needs disk space first (the
manifest, then the new pointer ``latest.tmp``); only renames follow: the folder
rename (the commit point: a crash after it resumes from the new tag) and
``os.replace`` of the pointer. When a step after the folder rename fails, the rename
and the pointer are undone, so a save that raised is never what a resume loads, and
the same tag can be saved again.

Nothing read from a checkpoint names a path: the manifest lists plain file names of
the folder (no separator, no ``..``, no leading dot), the ``latest`` pointer is
checked like a tag, symbolic links are refused, and dtype names are looked up in a
fixed table.

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
import stat
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
LATEST_TMP, LATEST_PREV = LATEST + ".tmp", LATEST + ".prev"
_RESERVED = (MANIFEST, LATEST, LATEST_TMP, LATEST_PREV)
DAMAGED = 1 << 62
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")

# dtype names as checkpoints store them (str(dtype) without "torch."): the only ones read back
DTYPE_BY_NAME = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool)}
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
    try:
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
    except OSError as e:
        raise write_error(path, e) from None
    return h.hexdigest(), size


def write_error(path: Path, e: OSError) -> CheckpointError:
    """The error of a failed write, naming the file (and so its folder) and the reason."""
    why = f"[Errno {e.errno}] {e.strerror}" if e.strerror else str(e)
    return CheckpointError(f"cannot write {path}: {why}")


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
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise write_error(path, e) from None
    return hashlib.sha256(data).hexdigest(), len(data)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- names, tags, the latest pointer -----------------------------------------------------------
def is_plain_name(name: object) -> bool:
    """A name directly inside a folder: letters, digits, '_', '-', '.'; no separator, no
    leading dot (so never '..'), at most 255 characters."""
    return isinstance(name, str) and len(name) <= 255 and _TAG_RE.fullmatch(name) is not None


def is_regular_file(path: Path) -> bool:
    """A regular file, not a symbolic link (never followed out of a checkpoint folder)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def is_real_dir(path: Path) -> bool:
    """A folder, not a symbolic link."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def check_tag(tag: str) -> str:
    """``tag`` if it names a checkpoint folder directly inside the checkpoints folder."""
    if not is_plain_name(tag) or tag in _RESERVED or tag.endswith((".tmp", ".deleting")):
        raise CheckpointError(f"invalid checkpoint tag {tag!r} (letters, digits, '_', '-', '.'; "
                              f"not {LATEST!r}, not starting with '.')")
    return tag


def tmp_dir(root: Path, tag: str) -> Path:
    return root / f".{tag}.tmp"


def read_latest(root: Path) -> str | None:
    """The tag ``root/latest`` names (None without a pointer), checked like a tag."""
    path = root / LATEST
    if not os.path.lexists(path):
        return None
    if not is_regular_file(path):
        raise CheckpointCorruptError(f"{path}: not a regular file (a symbolic link or a folder)")
    with open(path, "rb") as f:
        raw = f.read(300)
    try:
        return check_tag(raw.decode().strip())
    except (UnicodeDecodeError, CheckpointError):
        raise CheckpointCorruptError(f"{path}: does not name a checkpoint of this folder ({raw[:60]!r})") from None


def write_pointer(path: Path, tag: str) -> None:
    """Write and fsync a pointer file holding ``tag``."""
    try:
        with open(path, "w") as f:
            f.write(tag + "\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise write_error(path, e) from None


# -- commit, manifest ---------------------------------------------------------------------------
def _manifest_digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def commit(root: Path, tag: str, files: dict[str, tuple[str, int]], info: dict) -> Path:
    """Rank 0, after every rank fsynced its files into ``.<tag>.tmp``: write the manifest
    and the new pointer (the last writes that need disk space), rename the folder into
    place (the commit point), then replace ``latest``. A failure after the rename undoes
    it (:func:`_undo_commit`), so that whenever this raises (:class:`CheckpointError` or
    :class:`OSError`) nothing was committed, unless the message says otherwise."""
    tmp, final = tmp_dir(root, tag), root / tag
    body = {"format": FORMAT, "version": VERSION, "tag": tag, "seq": next_seq(root), **info,
            "files": {name: {"sha256": sha, "bytes": size} for name, (sha, size) in sorted(files.items())}}
    write_json(tmp / MANIFEST, {**body, "manifest_sha256": _manifest_digest(body)})
    fsync_dir(tmp)
    try:
        write_pointer(root / LATEST_TMP, tag)
        had_latest = _keep_previous_pointer(root)
    except (OSError, CheckpointError):
        _unlink(root / LATEST_TMP)
        raise
    try:
        os.rename(tmp, final)  # the commit point
    except OSError:
        _unlink(root / LATEST_TMP)
        _unlink(root / LATEST_PREV)
        raise
    try:
        fsync_dir(root)
        os.replace(root / LATEST_TMP, root / LATEST)
        fsync_dir(root)
    except OSError as e:
        _undo_commit(root, tag, had_latest, e)
    _unlink(root / LATEST_PREV)
    return final


def _keep_previous_pointer(root: Path) -> bool:
    """Keep the current pointer as ``latest.prev`` (a hard link: no disk space), so that an
    undone commit can put it back by a rename. Returns whether there was one."""
    latest, prev = root / LATEST, root / LATEST_PREV
    _unlink(prev)
    if not is_regular_file(latest):
        return False
    try:
        os.link(latest, prev)
    except OSError:  # a file system without hard links: copy it (still before the commit point)
        write_pointer(prev, latest.read_text().strip())
    return True


def _undo_commit(root: Path, tag: str, had_latest: bool, cause: OSError) -> None:
    """Put the previous pointer back and the folder back to ``.<tag>.tmp``; always raises."""
    final = root / tag
    why = f"[Errno {cause.errno}] {cause.strerror}" if cause.strerror else str(cause)
    try:
        if had_latest:
            os.replace(root / LATEST_PREV, root / LATEST)
            _unlink(root / LATEST_PREV)  # still there when latest never moved (rename of a link onto itself)
        elif os.path.lexists(root / LATEST):
            os.unlink(root / LATEST)
        os.rename(final, tmp_dir(root, tag))
        _unlink(root / LATEST_TMP)
        fsync_dir(root)
    except OSError as e:
        raise CheckpointError(f"{final} is committed (a resume loads it), but updating {root / LATEST} failed "
                              f"({why}) and undoing the commit failed too ({e})") from None
    raise CheckpointError(f"{final} was not committed: updating {root / LATEST} failed ({why}); "
                          "the commit was undone") from None


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _check_manifest(m: dict, path: Path) -> None:
    """Types of the manifest's fields; every listed file a plain name of the folder."""
    for key in ("seq", "world_size", "zero_stage", "global_steps"):
        if type(m.get(key)) is not int or m[key] < 0:
            raise CheckpointCorruptError(f"{path}: field {key!r} is not a non-negative integer ({m.get(key)!r})")
    if not isinstance(m.get("tag"), str) or not isinstance(m.get("files"), dict) \
            or not 1 <= m["world_size"] <= len(m["files"]):  # one file per rank at least
        raise CheckpointCorruptError(f"{path}: fields 'world_size', 'tag' or 'files' malformed")
    for name, entry in m["files"].items():
        if not is_plain_name(name) or name in _RESERVED:
            raise CheckpointCorruptError(f"{path}: lists {name!r}, which is not a plain file name inside "
                                         f"{path.parent} (refused)")
        if (not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str)
                or type(entry.get("bytes")) is not int or entry["bytes"] < 0):
            raise CheckpointCorruptError(f"{path}: entry of {name!r} malformed ({entry!r:.80})")


def read_manifest(folder: Path) -> dict:
    """The manifest of a committed folder, checked against its own checksum, its file
    entries plain names of the folder."""
    path = folder / MANIFEST
    if not is_regular_file(path):
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
    _check_manifest(m, path)
    return m


def verify_file(folder: Path, name: str, manifest: dict) -> None:
    """Size and SHA-256 of one file against the manifest (a plain name of the folder,
    a regular file)."""
    entry = manifest["files"].get(name)
    if entry is None or not is_plain_name(name):
        raise CheckpointCorruptError(f"{folder / str(name)}: not listed in the manifest")
    path = folder / name
    if not is_regular_file(path):
        raise CheckpointCorruptError(f"{path}: missing (or not a regular file)")
    size = path.stat().st_size
    if size != entry["bytes"]:
        how = "truncated" if size < entry["bytes"] else "has extra bytes"
        raise CheckpointCorruptError(f"{path}: {how} ({size} bytes, manifest says {entry['bytes']})")
    sha, _ = file_sha256(path)
    if sha != entry["sha256"]:
        raise CheckpointCorruptError(f"{path}: SHA-256 mismatch (content altered)")


def dtype_from_name(name: object, where: Path) -> torch.dtype:
    """A dtype name read from a checkpoint, looked up in :data:`DTYPE_BY_NAME` only."""
    dtype = DTYPE_BY_NAME.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise CheckpointCorruptError(f"{where}: unknown dtype {name!r}")
    return dtype


def committed_tags(root: Path) -> list[tuple[int, str]]:
    """(seq, tag) of every folder that has a manifest, newest first (damaged manifests first).
    Symbolic links and names that are not tags are ignored."""
    out = []
    if not root.is_dir():
        return out
    for p in root.iterdir():
        if is_plain_name(p.name) and p.name not in _RESERVED and is_real_dir(p) and is_regular_file(p / MANIFEST):
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
        if not is_real_dir(root / tag):
            raise CheckpointError(f"{root / tag}: no such checkpoint (or a symbolic link)")
        return [tag]
    tags = [t for _, t in committed_tags(root)]
    named = read_latest(root)
    if named is not None and named not in tags:
        if os.path.islink(root / named):
            raise CheckpointCorruptError(f"{root / LATEST}: names {named!r}, a symbolic link (refused)")
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
