"""Regressions of the hostile-checkpoint findings (issue 15): a save that raised is never
what a resume loads and can be retried (6); nothing a checkpoint names leads outside its
folder (7); a full disk is reported with the file and the folder (8)."""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.checkpoint.hostile import edit_json, engine, resign, save_two, watch_opens
from zeal.checkpoint import cli as ckpt_cli
from zeal.checkpoint import files as cio
from zeal.checkpoint.files import CheckpointCorruptError, CheckpointError

pytestmark = pytest.mark.timeout(120)
ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine") / "ck"
    save_two(root)
    return root


@pytest.fixture
def ck(pristine, tmp_path):
    root = tmp_path / "ck"
    shutil.copytree(pristine, root)
    return root


def _digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


class _FullDisk:
    """A file whose writes fail with ENOSPC."""

    def __init__(self, f) -> None:
        self.f = f

    def write(self, b) -> int:
        raise ENOSPC

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()


def _disk_full_for(monkeypatch, names: set[str]) -> None:
    """Writes of files with these names (in the checkpoint module) fail: the disk is full."""
    real = open

    def fake(path, mode="r", *a, **k):
        f = real(path, mode, *a, **k)
        return _FullDisk(f) if "w" in mode and Path(path).name in names else f

    monkeypatch.setattr(cio, "open", fake, raising=False)


# -- 6 and 8: a failed save ---------------------------------------------------------------------
@pytest.mark.parametrize("name", ["latest.tmp", "rank00000.safetensors", "meta.json", "manifest.json"])
def test_disk_full_save_names_file_and_folder_commits_nothing_and_retries(tmp_path, monkeypatch, name):
    root = tmp_path / "ck"
    e = engine()
    e.save_checkpoint(str(root), tag="a", client_state={"n": 1})
    before = _digests(root)
    _disk_full_for(monkeypatch, {name})
    with pytest.raises(CheckpointError) as exc:
        e.save_checkpoint(str(root), tag="b", client_state={"n": 2})
    monkeypatch.undo()
    msg = str(exc.value)
    assert "No space left on device" in msg and name in msg and str(root / "b") in msg, msg
    assert "\n" not in msg
    assert _digests(root) == before and sorted(p.name for p in root.iterdir()) == ["a", "latest"]
    assert engine().load_checkpoint(str(root)) == {"n": 1}  # resume: the last committed save
    e.save_checkpoint(str(root), tag="b", client_state={"n": 2})  # the retry with the same tag works
    assert engine().load_checkpoint(str(root)) == {"n": 2}
    assert (root / "latest").read_text() == "b\n"


@pytest.mark.parametrize("where", ["replace", "fsync_after_replace", "replace_first_save"])
def test_failure_after_the_folder_rename_is_undone(tmp_path, monkeypatch, where):
    root = tmp_path / "ck"
    e = engine()
    if where == "replace_first_save":
        root.mkdir()
    else:
        e.save_checkpoint(str(root), tag="a", client_state={"n": 1})
    before = _digests(root)
    real_replace, real_fsync = os.replace, cio.fsync_dir

    def bad_replace(src, dst):
        if Path(src).name == "latest.tmp":  # the pointer's move; undoing (latest.prev -> latest) works
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_replace(src, dst)

    def bad_fsync(path):
        if Path(path) == root and (root / "latest").read_text() == "b\n":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_fsync(path)

    if where.startswith("replace"):
        monkeypatch.setattr(cio.os, "replace", bad_replace)
    else:
        monkeypatch.setattr(cio, "fsync_dir", bad_fsync)
    with pytest.raises(CheckpointError, match="was not committed") as exc:
        e.save_checkpoint(str(root), tag="b", client_state={"n": 2})
    monkeypatch.undo()
    assert str(root / "b") in str(exc.value) and "latest" in str(exc.value)
    assert _digests(root) == before
    if where == "replace_first_save":
        with pytest.raises(CheckpointError, match="no committed checkpoint"):
            engine().load_checkpoint(str(root))
    else:
        assert engine().load_checkpoint(str(root)) == {"n": 1}
    e.save_checkpoint(str(root), tag="b", client_state={"n": 2})
    assert engine().load_checkpoint(str(root)) == {"n": 2}


def test_failed_retention_after_commit_does_not_fail_the_save(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    e = engine(checkpoint={"keep_last": 1})
    e.save_checkpoint(str(root), tag="a")

    def failing(*a, **k):
        raise ENOSPC

    monkeypatch.setattr(cio, "prune", failing)
    e.save_checkpoint(str(root), tag="b", client_state={"n": 2})  # committed: must not raise
    monkeypatch.undo()
    assert engine().load_checkpoint(str(root)) == {"n": 2}


# -- 7: paths confined to the checkpoint folder ---------------------------------------------------
def _outside(tmp_path: Path, ck: Path) -> Path:
    out = tmp_path / "outside"
    out.mkdir(exist_ok=True)
    shutil.copy(ck / "new" / "rank00000.safetensors", out / "outside_shard.safetensors")
    (out / "x").write_text("secret\n")
    return out


def _inspect(path: Path, capsys) -> tuple[int, str, str]:
    rc = ckpt_cli.inspect(argparse.Namespace(checkpoint=str(path), tag=None))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("entry", ["../../outside/x", "ABS", "../../outside/outside_shard.safetensors",
                                   "/etc/hostname", "../old/meta.json", "sub/x", ".hidden", "latest"])
def test_manifest_entry_outside_the_folder_is_refused(ck, tmp_path, monkeypatch, capsys, entry):
    out = _outside(tmp_path, ck)
    entry = str(out / "x") if entry == "ABS" else entry
    target = Path(entry) if entry.startswith("/") else ck / "new" / entry
    sha, size = cio.file_sha256(target) if target.is_file() else ("0" * 64, 1)
    edit_json(ck / "new" / cio.MANIFEST, lambda m: m["files"].update({entry: {"sha256": sha, "bytes": size}}))
    resign(ck / "new")
    with watch_opens(out, monkeypatch) as hits, watch_opens(Path("/etc"), monkeypatch) as etc:
        with pytest.raises(CheckpointCorruptError, match="not a plain file name") as exc:
            engine().load_checkpoint(str(ck))
        rc, printed, err = _inspect(ck / "new", capsys)
    assert "manifest.json" in str(exc.value) and entry in str(exc.value)
    assert rc == 1 and "sha256 ok" not in printed and "not a plain file name" in err and err.count("\n") == 1
    assert hits == [] and etc == []


def test_meta_listing_a_shard_outside_is_refused(ck, tmp_path, monkeypatch):
    out = _outside(tmp_path, ck)
    edit_json(ck / "new" / "meta.json", lambda m: m.update(files=["../../outside/outside_shard.safetensors"]))
    resign(ck / "new")
    with watch_opens(out, monkeypatch) as hits:
        with pytest.raises(CheckpointCorruptError, match="meta.json: lists the files"):
            engine().load_checkpoint(str(ck))
    assert hits == []


@pytest.mark.parametrize("pointer", ["../sibling/evil", "ABS", "evil_link", ".new.tmp", "new/../old", "",
                                     "new\nold", "latest", "x" * 400])
def test_latest_pointer_is_checked_like_a_tag(ck, tmp_path, monkeypatch, pointer):
    sibling = tmp_path / "sibling"
    shutil.copytree(ck / "new", sibling / "evil")
    os.symlink(sibling / "evil", ck / "evil_link")
    pointer = str(sibling / "evil") if pointer == "ABS" else pointer
    (ck / "latest").write_text(pointer + "\n")
    with watch_opens(sibling, monkeypatch) as hits:
        with pytest.raises(CheckpointCorruptError, match="latest"):
            engine().load_checkpoint(str(ck))
        with pytest.raises(CheckpointError, match="symbolic link"):
            engine().load_checkpoint(str(ck), tag="evil_link")
    assert hits == []


def test_symlinked_files_and_latest_are_refused(ck, tmp_path, monkeypatch):
    out = _outside(tmp_path, ck)
    shutil.copy(ck / "new" / "rank00000.safetensors", out / "same.safetensors")
    (ck / "new" / "rank00000.safetensors").unlink()
    os.symlink(out / "same.safetensors", ck / "new" / "rank00000.safetensors")  # identical bytes: sha matches
    with watch_opens(out, monkeypatch) as hits:
        with pytest.raises(CheckpointCorruptError, match="rank00000.safetensors: missing .or not a regular file"):
            engine().load_checkpoint(str(ck))
    (ck / "latest").unlink()
    (out / "ptr").write_text("old\n")
    os.symlink(out / "ptr", ck / "latest")
    with watch_opens(out, monkeypatch) as hits2:
        with pytest.raises(CheckpointCorruptError, match="latest: not a regular file"):
            engine().load_checkpoint(str(ck))
    assert hits == [] and hits2 == []


def test_dtype_names_come_from_a_fixed_table(ck, monkeypatch):
    called = []
    monkeypatch.setattr(torch, "evil_dtype", lambda *a: called.append(a), raising=False)
    edit_json(ck / "new" / "meta.json", lambda m: next(iter(m["params"].values())).update(dtype="evil_dtype"))
    resign(ck / "new")
    with pytest.raises(CheckpointCorruptError, match="meta.json: 'params' is not a map of tensor entries"):
        engine().load_checkpoint(str(ck), tag="new")
    # a scalar's dtype in a rank file's index
    path = ck / "old" / "rank00000.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        md = json.loads(f.metadata()["zeal"])
    name = next(iter(md["scalars"]))
    md["scalars"][name]["step"][1] = "evil_dtype"
    save_file(tensors, str(path), metadata={"zeal": json.dumps(md)})
    resign(ck / "old")
    with pytest.raises(CheckpointCorruptError, match="rank00000.safetensors: index of saved pieces malformed"):
        engine().load_checkpoint(str(ck), tag="old")
    assert called == []


@pytest.mark.parametrize("kind", ["param", "optim.exp_avg_sq"])
def test_tensor_stored_in_another_dtype_than_the_index_is_refused(ck, kind):
    """Regression (issue 31): a master or an Adam moment rewritten as fp16 (the index says
    fp32), manifest re-signed, loaded and was silently rounded."""
    path = ck / "new" / "rank00000.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        md = f.metadata()
    key = next(k for k in tensors if k.startswith(kind + "/"))
    tensors[key] = tensors[key].half()
    save_file(tensors, str(path), metadata=md)
    resign(ck / "new")
    with pytest.raises(CheckpointCorruptError, match=f"rank00000.safetensors: {key} is stored as float16, "
                                                     "the index says float32"):
        engine().load_checkpoint(str(ck), tag="new")
