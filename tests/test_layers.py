"""The layer rule: zeal's packages form a declared order, and a package imports only from
packages below its own layer (never from a sibling of the same layer, never from above).

Every import statement counts, wherever it is in the file: module level, inside a function
(the lazy imports that hide a cycle), under ``if TYPE_CHECKING:``. The imports that break
the rule today are listed in ``ALLOWED`` with the reason and the way out; the list may only
shrink: an allowed import that no longer exists fails the test, so whoever removes one
removes its line too. docs/ARCHITECTURE.md ("The layers and their rule") states the same order.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "zeal"

# Bottom to top. ``zeal`` is the public API (zeal/__init__.py): it re-exports training and
# serving, so it sits above both; only the front ends (rlhf, the integrations, the CLI) use it.
LAYERS: list[tuple[str, ...]] = [
    ("utils",),                            # process settings, cache folder, CPU features
    ("config",),                           # the typed config tree ("auto" resolved here)
    ("dist",),                             # contexts, the mesh, accounted Comms, forensics
    ("precision", "models", "data"),       # dtypes/loss scaling; plain model code; corpora, samplers
    ("zero",),                             # where every byte lives
    ("compression", "pipe"),               # N:M/QAT (over ZeRO shards); pipeline stages and schedules
    ("parallel",),                         # tensor / vocab parallelism, the tp RNG tracker
    ("moe",),                              # experts, dispatch, expert parallelism (over tp, pp and ZeRO)
    ("checkpoint",),                       # save / load / export over the sharded-state API
    ("lora",),                             # LoRA / QLoRA adapters, PEFT folders (over tp, moe, checkpoint files)
    ("train", "inference"),                # the training engine; the serving engine (neither knows the other)
    ("zeal",),                             # the public API
    ("rlhf", "integrations", "deepspeed"),  # built on training + serving; HF Trainer; DeepSpeed's API
    ("cli",),                              # the commands
]

# (importing module, imported module): the upward (or sideways) imports of today. Each says
# why it is there and what removes it. Remove the line with the import.
ALLOWED: dict[tuple[str, str], str] = {
    # utils → config: apply_process_settings validates a dict with the section's model.
    # Out: take a ProcessConfig only, or move process.py into config/.
    ("zeal.utils.process", "zeal.config.process"): "process settings validated by their config section",
    # models → moe: the MoE MLP block is built from moe's layer (a model component), and
    # moe/__init__ pulls the apply side with it. Out: the layer (gating, dispatch, experts)
    # below models, the apply side (apply, zero, layout, tensor, recompute) above.
    ("zeal.models.moe_mlp", "zeal.moe"): "MoE MLP block uses moe's layer",
    # models → compression: loading a compressed-tensors folder dequantizes it.
    # Out: the decompressor registered by compression, or hf.py's loader moved up.
    ("zeal.models.hf", "zeal.compression.export"): "compressed-tensors folders dequantized on load",
    ("zeal.checkpoint.export", "zeal.lora.merge"): "export --merge-lora folds a checkpoint's adapters in",
    # pipe → train: PipelineEngine is a TrainEngine for one stage (train/build.py builds it).
    # Out: pipe/engine.py moves into train/.
    ("zeal.pipe.engine", "zeal.train.engine"): "PipelineEngine subclasses TrainEngine",
    ("zeal.pipe.engine", "zeal.train.hooks"): "PipelineEngine walks the train step hooks",
}


def _package(module: str) -> str:
    """``zeal.zero.apply`` → ``zero``; ``zeal`` (the root) → ``zeal``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "zeal"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, module: str, is_package: bool = False) -> list[tuple[str, int]]:
    """Every ``zeal`` module that ``source`` (the text of ``module``) imports, with its line:
    every Import / ImportFrom node anywhere in the tree, relative imports resolved.
    ``from zeal import X`` names the root, ``from zeal.a import b`` names ``zeal.a``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                names = [".".join(base + ([node.module] if node.module else []))]
            else:
                names = [node.module or ""]
            if names == ["zeal"]:  # from zeal import checkpoint: the subpackage, else the root's API
                names = [f"zeal.{a.name}" if a.name in _layer_of() else "zeal" for a in node.names]
        else:
            continue
        out += [(n, node.lineno) for n in names if n == "zeal" or n.startswith("zeal.")]
    return out


def _layer_of() -> dict[str, int]:
    return {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


@functools.cache
def crossings(root: Path = ROOT) -> dict[tuple[str, str], list[str]]:
    """``(importing module, imported module)`` → where, for every import that breaks the rule."""
    layer = _layer_of()
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        module = _module_name(path, root)
        src_pkg = _package(module)
        for target, line in imports_of(path.read_text(), module, path.name == "__init__.py"):
            dst_pkg = _package(target)
            if dst_pkg == src_pkg or layer[dst_pkg] < layer[src_pkg]:
                continue
            found.setdefault((module, target), []).append(f"{path.relative_to(root.parent)}:{line}")
    return found


def test_every_package_has_a_layer():
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists() or
                (p.is_dir() and any(p.glob("*.py")))} | {"zeal"}
    placed = [pkg for layer in LAYERS for pkg in layer]
    assert len(placed) == len(set(placed)), "a package is placed twice"
    assert packages == set(placed), (f"not placed: {sorted(packages - set(placed))}; "
                                     f"placed but gone: {sorted(set(placed) - packages)}")


def test_no_new_upward_import():
    layer = _layer_of()
    new = {edge: where for edge, where in crossings().items() if edge not in ALLOWED}
    lines = [f"{', '.join(where)}: {a} imports {b} (layer {layer[_package(a)]} → {layer[_package(b)]})"
             for (a, b), where in sorted(new.items())]
    assert not new, ("imports against the layer order (import only from lower layers; see "
                     "tests/test_layers.py LAYERS and docs/ARCHITECTURE.md):\n" + "\n".join(lines))


def test_allow_list_only_shrinks():
    stale = sorted(set(ALLOWED) - set(crossings()))
    assert not stale, f"these allowed imports are gone: remove them from ALLOWED: {stale}"


def test_nothing_outside_the_cli_imports_it():
    """The serving engine is built in zeal/inference/build.py, not by the ``serve`` command."""
    assert not [edge for edge in crossings() if _package(edge[1]) == "cli"]
    assert not [edge for edge in ALLOWED if _package(edge[1]) == "cli"]


@pytest.mark.parametrize("source,expected", [
    ("import zeal.zero.apply", ["zeal.zero.apply"]),
    ("def f():\n    from zeal.cli.serve import load_engine\n", ["zeal.cli.serve"]),  # lazy
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from zeal.train import engine\n", ["zeal.train"]),
    ("class A:\n    def m(self):\n        import zeal\n", ["zeal"]),
    ("from zeal import checkpoint, initialize\n", ["zeal.checkpoint", "zeal"]),
    ("from ..moe import layer\nfrom . import units\n", ["zeal.moe", "zeal.zero"]),  # relative
    ("import torch, os\nfrom zealous import x\n", []),
])
def test_the_scanner_sees_every_import(source, expected):
    assert sorted(n for n, _ in imports_of(source, "zeal.zero.apply")) == sorted(expected)


def test_an_upward_import_fails(tmp_path):
    """A package tree with one lazy upward import: the rule finds it (the test can fail)."""
    pkg = tmp_path / "zeal"
    for name in ("zero", "train", "utils"):
        (pkg / name).mkdir(parents=True)
        (pkg / name / "__init__.py").write_text("")
    (pkg / "zero" / "apply.py").write_text("import torch\n\ndef f():\n    from zeal.train.engine import E\n")
    (pkg / "train" / "engine.py").write_text("from zeal.zero.apply import f\nfrom zeal.utils import x\n")
    assert crossings(pkg) == {("zeal.zero.apply", "zeal.train.engine"): ["zeal/zero/apply.py:4"]}
