"""Checkpoint failure handling: kill during save, corruption matrix, pickle payloads,
fallback, keep_last, save-failure isolation, no committed checkpoint.

The kill test forks savers from a forkserver that has torch and zeal imported, so a
trial costs a fork, not an interpreter start."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import pickle
import random
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.checkpoint.test_resume_reshard import config, train
from tests.dist_harness import run_ranks
from tests.train.models import TinyNet
from zeal.checkpoint import files as cio
from zeal.checkpoint.files import CheckpointCorruptError, CheckpointError

SEED = int(os.environ.get("ZEAL_TEST_SEED", "1234"))


class Mlp(nn.Module):
    """About 0.8M parameters: a save takes long enough to be interrupted at many points."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(256, 1024), nn.Tanh(), nn.Linear(1024, 512))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).pow(2).mean()


def _mlp_engine(keep_last: int | None = 2):
    import zeal

    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1},
           "checkpoint": {"keep_last": keep_last}}
    engine = zeal.initialize(Mlp(), cfg)
    loss = engine(torch.randn(2, 256))
    engine.backward(loss)
    engine.step()
    return engine


def _saver(root: str, conn) -> None:
    torch.set_num_threads(1)
    engine = _mlp_engine()
    conn.send("ready")
    n = 0
    while True:
        n += 1
        engine.save_checkpoint(root, tag=f"t{time.time_ns()}_{n}")


def _digests(root: Path) -> dict[str, dict[str, str]]:
    out = {}
    for _, tag in cio.committed_tags(root):
        out[tag] = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted((root / tag).iterdir())}
    return out


def _kill_trials(tmp_path: Path, trials: int) -> None:
    ctx = mp.get_context("forkserver")
    # torch._dynamo: the optimizer step imports it lazily (seconds); preloaded once, not per saver
    ctx.set_forkserver_preload(["torch._dynamo", "tests.checkpoint.test_faults"])
    root = tmp_path / "kill"
    loader = _mlp_engine()
    loader.save_checkpoint(str(root), tag="t0")
    rng = random.Random(SEED)
    loaded_tags = set()
    mid_write = 0
    for trial in range(trials):
        before = _digests(root)
        a, b = ctx.Pipe()
        proc = ctx.Process(target=_saver, args=(str(root), b), daemon=True)
        proc.start()
        assert a.poll(60) and a.recv() == "ready"
        time.sleep(rng.uniform(0.0, 0.25))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        after = _digests(root)
        mid_write += any(p.name.endswith(".tmp") for p in root.iterdir())
        for tag in set(before) & set(after):
            assert before[tag] == after[tag], f"trial {trial}: committed {tag} changed"
        newest = cio.committed_tags(root)[0][1]
        loader.load_checkpoint(str(root))  # newest committed, verified; raises on anything partial
        assert cio.resolve_tags(root, None)[0] == newest
        loaded_tags.add(newest)
    assert len(loaded_tags) > 1, "the saver never committed: the trials did not exercise anything"
    print(f"kill-during-save: {trials}/{trials} recovered the newest committed tag "
          f"({mid_write} killed with a save folder half written), seed {SEED}")


@pytest.mark.timeout(180)
def test_kill_during_save_keeps_newest_committed(tmp_path):
    _kill_trials(tmp_path, 10)  # the long tier's test_kill_during_save_many runs 200


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_kill_during_save_many(tmp_path):
    _kill_trials(tmp_path, 200)


# -- corruption matrix ---------------------------------------------------------------------------
def _save_two(rank: int, world: int, root: str) -> None:
    import zeal

    torch.manual_seed(0)
    engine = zeal.initialize(TinyNet(), config(1))
    train(engine, rank, world, range(0, 2))
    engine.save_checkpoint(root, tag="old")
    train(engine, rank, world, range(2, 3))
    engine.save_checkpoint(root, tag="new", client_state={"step": 3})


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine")
    run_ranks(_save_two, 2, str(root), timeout=120)
    return root


def _engine(fallback: bool = False):
    import zeal

    torch.manual_seed(5)
    return zeal.initialize(TinyNet(), config(1, checkpoint={"fallback_to_previous": fallback}))


def _resign(folder: Path) -> None:
    """Recompute the manifest as an attacker with write access would."""
    m = json.loads((folder / cio.MANIFEST).read_text())
    for name in m["files"]:
        sha, size = cio.file_sha256(folder / name)
        m["files"][name] = {"sha256": sha, "bytes": size}
    body = {k: v for k, v in m.items() if k != "manifest_sha256"}
    m["manifest_sha256"] = cio._manifest_digest(body)
    (folder / cio.MANIFEST).write_text(json.dumps(m))


def _on_file(fn, name: str):
    return lambda folder: fn(folder / name)


def _mutations():
    def flip(p: Path) -> None:
        b = bytearray(p.read_bytes())
        b[len(b) // 2] ^= 0x10
        p.write_bytes(bytes(b))

    return {
        "delete": lambda p: p.unlink(),
        "truncate0": lambda p: p.write_bytes(b""),
        "truncate_half": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
        "flip_byte": flip,
        "append_garbage": lambda p: p.write_bytes(p.read_bytes() + b"garbage!"),
    }


def _manifest_edits():
    def edit(fn):
        def apply(folder: Path) -> None:
            m = json.loads((folder / cio.MANIFEST).read_text())
            fn(m)
            (folder / cio.MANIFEST).write_text(json.dumps(m))
        return apply

    def sha_of(name):
        return edit(lambda m: m["files"][name].update(sha256="0" * 64))

    return {
        "sha_rank0": sha_of("rank00000.safetensors"), "sha_rank1": sha_of("rank00001.safetensors"),
        "sha_meta": sha_of("meta.json"),
        "size_rank1": edit(lambda m: m["files"]["rank00001.safetensors"].update(bytes=1)),
        "world_size": edit(lambda m: m.update(world_size=3)),
        "drop_entry": edit(lambda m: m["files"].pop("rank00001.safetensors")),
        "swap_ranks": lambda f: (os.replace(f / "rank00000.safetensors", f / "x"),
                                 os.replace(f / "rank00001.safetensors", f / "rank00000.safetensors"),
                                 os.replace(f / "x", f / "rank00001.safetensors")),
        "swap_ranks_resigned": lambda f: (os.replace(f / "rank00000.safetensors", f / "x"),
                                          os.replace(f / "rank00001.safetensors", f / "rank00000.safetensors"),
                                          os.replace(f / "x", f / "rank00001.safetensors"), _resign(f)),
    }


@pytest.mark.timeout(120)
def test_corruption_matrix_clear_error_and_fallback(pristine, tmp_path):
    files = sorted(p.name for p in (pristine / "new").iterdir())
    assert files == ["manifest.json", "meta.json", "rank00000.safetensors", "rank00001.safetensors"]
    cases = [(f"{f}:{k}", _on_file(fn, f)) for f in files for k, fn in _mutations().items()]
    cases += [(f"manifest:{k}", fn) for k, fn in _manifest_edits().items()]
    strict, lenient = _engine(), _engine(fallback=True)
    want_old = None
    errors = 0
    for name, mutate in cases:
        root = tmp_path / name.replace(":", "_")
        shutil.copytree(pristine, root)
        mutate(root / "new")
        with pytest.raises(CheckpointError) as exc:
            strict.load_checkpoint(str(root))
            print("silent load:", name)
        msg = str(exc.value)
        assert "new" in msg and ("manifest" in msg or ".json" in msg or ".safetensors" in msg), (name, msg)
        assert isinstance(exc.value, CheckpointCorruptError), (name, msg)
        errors += 1
        state = lenient.load_checkpoint(str(root))  # falls back to "old"
        assert state == {}, name
        if want_old is None:
            want_old = lenient.module_state_dict()
        assert all(torch.equal(want_old[k], v) for k, v in lenient.module_state_dict().items()), name
    assert errors == len(cases) >= 28
    # the untouched checkpoint loads, and a named tag never falls back
    assert _engine().load_checkpoint(str(pristine)) == {"step": 3}
    root = tmp_path / "named"
    shutil.copytree(pristine, root)
    (root / "new" / "rank00001.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointCorruptError, match="rank00001.safetensors"):
        lenient.load_checkpoint(str(root), tag="new")


class _Payload:
    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


@pytest.mark.timeout(60)
def test_pickle_payload_is_refused_and_never_executed(pristine, tmp_path):
    sentinel = tmp_path / "PWNED"
    blobs = {"pickle": pickle.dumps({"w": _Payload(sentinel)})}
    buf = tmp_path / "torch_save.pt"
    torch.save({"w": _Payload(sentinel)}, buf)
    blobs["torch_save"] = buf.read_bytes()
    n = 0
    for kind, blob in blobs.items():
        for target in ["rank00000.safetensors", "rank00001.safetensors", "meta.json", "manifest.json"]:
            for resign in (False, True):
                root = tmp_path / f"{kind}_{target}_{resign}"
                shutil.copytree(pristine, root)
                (root / "new" / target).write_bytes(blob)
                if resign and target != "manifest.json":
                    _resign(root / "new")
                with pytest.raises(CheckpointError, match=target.replace(".", r"\.")):
                    _engine().load_checkpoint(str(root), tag="new")
                n += 1
    assert not sentinel.exists()
    assert n == 16


@pytest.mark.timeout(60)
def test_keep_last_failure_isolation_and_no_committed(tmp_path, monkeypatch):
    engine = _mlp_engine(keep_last=2)
    root = tmp_path / "k"
    for i in range(4):
        engine.save_checkpoint(str(root), tag=f"s{i}")
    assert [t for _, t in cio.committed_tags(root)] == ["s3", "s2"]
    assert (root / "latest").read_text().strip() == "s3"
    with pytest.raises(CheckpointError, match="already exists"):
        engine.save_checkpoint(str(root), tag="s3")
    before = _digests(root)

    def failing(path, specs, metadata=None):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cio, "write_safetensors", failing)
    with pytest.raises(CheckpointError, match="No space left"):
        engine.save_checkpoint(str(root), tag="s4")
    monkeypatch.undo()
    assert _digests(root) == before and not any(p.name.startswith(".") for p in root.iterdir())
    engine.save_checkpoint(str(root), tag="s4")  # the next save works
    assert cio.committed_tags(root)[0][1] == "s4"
    # nothing committed: an error, never a silent fresh start
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / ".x.tmp").mkdir()
    for folder in (empty, tmp_path / "missing"):
        with pytest.raises(CheckpointError, match="no committed checkpoint|no such"):
            engine.load_checkpoint(str(folder))
    (empty / "latest").write_text("ghost\n")
    with pytest.raises(CheckpointError, match="ghost"):
        engine.load_checkpoint(str(empty))
