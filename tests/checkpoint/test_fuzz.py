"""Checkpoint folders mutated at random (hypothesis, derandomized, bounded): flipped
bytes, truncation, renamed / removed / added files and folders, edited JSON (manifest,
meta, a rank file's index), path entries pointing outside, symbolic links, a hostile
``latest``; with or without an attacker re-signing the manifest afterwards.

Oracle, on a tiny model at world size 1: every load either restores a committed state
exactly (the newest when only ``old`` was touched; without re-signing, nothing else), or
raises :class:`CheckpointError` naming the checkpoint folder or a file in it, and never
opens a file outside the checkpoint folder (a sentinel folder beside it, holding
valid-looking copies, is watched)."""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from tests.checkpoint.hostile import engine, resign, same, save_two, snapshot, watch_opens
from tests.tiers import budget
from zeal.checkpoint import files as cio
from zeal.checkpoint.files import CheckpointError

EXAMPLES = int(os.environ.get("ZEAL_FUZZ_EXAMPLES", "400"))  # the long tier's budget
TAGS = ["new", "old"]
FILES = ["manifest.json", "meta.json", "rank00000.safetensors"]
HOSTILE = [None, -1, 0, 10**30, 1.5, "x", "", "../../outside/x", "/etc/hostname", [], {}, True, float("nan"),
           "evil_dtype", "../../outside/outside_shard.safetensors", [1, 2], [[0, 10**30]], "<delete>"]
POINTERS = ["old", "new", "ghost", "../outside/evil", "", "new/../old", ".new.tmp", "latest", "\x00", "x" * 300]
OUTSIDE = ["manifest_entry", "meta_files", "symlink_rank", "symlink_folder", "latest_outside", "manifest_abs"]
FILE_NAMES = re.compile(r"manifest\.json|meta\.json|rank\d{5}\.safetensors|latest|/(new|old|ghost)\b")

_tag, _file = st.sampled_from(TAGS), st.sampled_from(FILES)
MUTATION = st.one_of(
    st.tuples(st.just("flip"), _tag, _file, st.floats(0, 1), st.integers(1, 255)),
    st.tuples(st.just("flip"), _tag, st.just("rank00000.safetensors"), st.floats(0.99, 1), st.integers(1, 255)),
    st.tuples(st.just("truncate"), _tag, _file, st.floats(0, 1)),
    st.tuples(st.just("remove"), _tag, st.sampled_from([*FILES, "<folder>"])),
    st.tuples(st.just("rename"), _tag, st.sampled_from([*FILES, "<folder>"]),
              st.sampled_from(["x", "rank00001.safetensors", "meta.json", ".new.tmp", "old", "new2"])),
    st.tuples(st.just("add"), st.sampled_from([*TAGS, "<root>"]),
              st.sampled_from(["extra.bin", "rank00001.safetensors", "latest.prev", "zz"]), st.binary(max_size=32)),
    st.tuples(st.just("edit"), _tag, st.sampled_from(["manifest.json", "meta.json", "index"]),
              st.integers(0, 10**6), st.sampled_from(HOSTILE)),
    st.tuples(st.just("outside"), _tag, st.sampled_from(OUTSIDE)),
    st.tuples(st.just("latest"), st.sampled_from(POINTERS)),
)


def _paths(doc, prefix=()):
    """Every key path of a JSON document."""
    if isinstance(doc, dict):
        items = doc.items()
    elif isinstance(doc, list):
        items = enumerate(doc)
    else:
        return
    for k, v in items:
        yield (*prefix, k)
        yield from _paths(v, (*prefix, k))


def _edit(doc, pick: int, value):
    paths = list(_paths(doc))
    if not paths:
        return value if value != "<delete>" else doc
    *head, last = paths[pick % len(paths)]
    node = doc
    for k in head:
        node = node[k]
    if value == "<delete>":
        del node[last]
    else:
        node[last] = value
    return doc


def _edit_index(path: Path, pick: int, value) -> None:
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        md = json.loads(f.metadata()["zeal"])
    save_file(tensors, str(path), metadata={"zeal": json.dumps(_edit(md, pick, value))})


def _outside(kind: str, folder: Path, out: Path) -> None:
    root = folder.parent
    if kind in ("manifest_entry", "manifest_abs"):
        name = "../../outside/x" if kind == "manifest_entry" else str(out / "x")
        sha, size = cio.file_sha256(out / "x")
        m = json.loads((folder / cio.MANIFEST).read_text())
        m["files"][name] = {"sha256": sha, "bytes": size}
        (folder / cio.MANIFEST).write_text(json.dumps(m))
    elif kind == "meta_files":
        m = json.loads((folder / "meta.json").read_text())
        m["files"] = ["../../outside/outside_shard.safetensors"]
        (folder / "meta.json").write_text(json.dumps(m))
    elif kind == "symlink_rank":
        (folder / "rank00000.safetensors").unlink()
        os.symlink(out / "outside_shard.safetensors", folder / "rank00000.safetensors")
    elif kind == "symlink_folder":
        shutil.rmtree(folder)
        os.symlink(out / "evil", folder)
    else:
        (root / "latest").write_text("../outside/evil\n")


def _apply(mutation: tuple, root: Path, out: Path) -> None:
    kind, target, *args = mutation
    folder = root / target
    if kind != "latest" and target in TAGS and not (folder.is_dir() and not folder.is_symlink()):
        return  # an earlier mutation removed or replaced it
    if kind == "flip" and (folder / args[0]).is_file():
        p = folder / args[0]
        b = bytearray(p.read_bytes())
        if b:
            b[min(len(b) - 1, int(args[1] * len(b)))] ^= args[2]
            p.write_bytes(bytes(b))
    elif kind == "truncate" and (folder / args[0]).is_file():
        p = folder / args[0]
        p.write_bytes(p.read_bytes()[: int(args[1] * p.stat().st_size)])
    elif kind in ("remove", "rename"):
        p = folder if args[0] == "<folder>" else folder / args[0]
        dest = (root if args[0] == "<folder>" else folder) / (args[1] if kind == "rename" else "")
        if kind == "remove" and p.is_dir():
            shutil.rmtree(p)
        elif kind == "remove" and p.exists():
            p.unlink()
        elif kind == "rename" and p.exists() and not dest.exists():
            os.rename(p, dest)
    elif kind == "add":
        (root if target == "<root>" else folder).joinpath(args[0]).write_bytes(args[1])
    elif kind == "edit" and args[0] == "index":
        try:
            _edit_index(folder / "rank00000.safetensors", *args[1:])
        except Exception:  # noqa: BLE001 - an earlier mutation broke the file: nothing to edit
            pass
    elif kind == "edit" and (folder / args[0]).is_file():
        try:
            doc = json.loads((folder / args[0]).read_text())
        except ValueError:
            return
        (folder / args[0]).write_text(json.dumps(_edit(doc, *args[1:])))
    elif kind == "outside":
        try:
            _outside(args[0], folder, out)
        except (ValueError, KeyError, TypeError, AttributeError, OSError):
            pass  # an earlier mutation mangled what this one edits
    elif kind == "latest":
        (root / "latest").write_text(target + "\n")


def _setup(base: Path, pristine: Path) -> tuple[Path, Path]:
    root, out = base / "ck", base / "outside"
    shutil.copytree(pristine, root)
    out.mkdir()
    shutil.copy(pristine / "new" / "rank00000.safetensors", out / "outside_shard.safetensors")
    shutil.copytree(pristine / "new", out / "evil")
    (out / "x").write_text("secret\n")
    return root, out


@pytest.fixture(scope="module")
def committed(tmp_path_factory):
    """The pristine folder and the state each committed tag restores."""
    root = tmp_path_factory.mktemp("fuzz") / "ck"
    save_two(root)
    states = {}
    for tag in TAGS:
        e = engine()
        states[tag] = snapshot(e, e.load_checkpoint(str(root), tag=tag))
    return root, states


@pytest.mark.timeout(600)
@budget(ci=40, long=EXAMPLES)
def test_mutated_checkpoints_load_exactly_or_fail_naming_a_file(committed, tmp_path_factory, monkeypatch, max_examples):
    pristine, states = committed
    base_dir = tmp_path_factory.mktemp("examples")
    stats, kinds = collections.Counter(), collections.Counter()

    @settings(max_examples=max_examples, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(MUTATION, min_size=1, max_size=3), st.booleans(), st.booleans())
    def run(mutations, resigned, fallback):
        base = Path(tempfile.mkdtemp(dir=base_dir))
        try:
            root, out = _setup(base, pristine)
            for m in mutations:
                _apply(m, root, out)
            if resigned:
                for tag in TAGS:
                    if (root / tag / cio.MANIFEST).is_file() and not (root / tag).is_symlink():
                        try:
                            resign(root / tag)
                        except (ValueError, KeyError, TypeError, AttributeError, OSError):
                            pass  # the attacker's own tool choked on a mangled manifest
            e = engine(checkpoint={"fallback_to_previous": fallback})
            with watch_opens(base, monkeypatch) as hits, watch_opens(Path("/etc"), monkeypatch) as etc:
                try:
                    client = e.load_checkpoint(str(root))
                    outcome = None
                except CheckpointError as err:
                    outcome = str(err)
            stats["tried"] += 1
            stats["resigned"] += resigned
            kinds.update(m[0] if m[0] != "outside" else f"outside:{m[2]}" for m in mutations)
            outside = [h for h in hits if not h.startswith(os.path.realpath(root) + os.sep)] + etc
            assert not outside, (mutations, resigned, outside)
            if outcome is not None:
                assert str(root) in outcome and FILE_NAMES.search(outcome), (mutations, resigned, outcome)
                stats["refused"] += 1
            else:
                got = snapshot(e, client)
                matches = [t for t in TAGS if same(got, states[t])]
                only_old = all(m[0] != "latest" and m[1] == "old" and m[-1] != "latest_outside" for m in mutations)
                if only_old and not resigned:
                    assert matches == ["new"], (mutations, resigned)
                elif not resigned:
                    assert matches, (mutations, resigned)
                stats["loaded_exact" if matches else "loaded_resigned_content"] += 1
            stats["handled"] += 1
        finally:
            shutil.rmtree(base, ignore_errors=True)

    run()
    print(f"\nmutated checkpoints: {dict(stats)}; mutations: {dict(kinds)}")
    assert stats["handled"] == stats["tried"] >= 3 * max_examples // 4
    assert stats["refused"] and stats["loaded_exact"]
