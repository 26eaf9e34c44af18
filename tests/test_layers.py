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
    ("moe.layer",),                        # the MoE layer a model holds: gating, dispatch, experts
    ("precision", "models", "data"),       # dtypes/loss scaling; plain model code; corpora, samplers
    ("zero",),                             # where every byte lives
    ("compression", "pipe"),               # N:M/QAT (over ZeRO shards); pipeline stages and schedules
    ("parallel",),                         # tensor / vocab parallelism, the tp RNG tracker
    ("moe",),                              # moe's apply side: expert parallelism (over tp, pp and ZeRO)
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
    ("zeal.checkpoint.export", "zeal.lora.merge"): "export --merge-lora folds a checkpoint's adapters in",
    # pipe → train: PipelineEngine is a TrainEngine for one stage (train/build.py builds it).
    # Out: pipe/engine.py moves into train/.
    ("zeal.pipe.engine", "zeal.train.engine"): "PipelineEngine subclasses TrainEngine",
    ("zeal.pipe.engine", "zeal.train.hooks"): "PipelineEngine walks the train step hooks",
}


# Modules placed apart from their package. zeal.moe has two sides: the layer (a model
# component: the nn.Module a model's MoE block holds, importing only dist) below models, and
# the apply side (apply, zero, tensor, layout and the package's __init__, whose apply-side
# names load lazily) above parallel and zero.
UNITS: dict[str, str] = {f"zeal.moe.{m}": "moe.layer" for m in ("layer", "gating", "dispatch", "mappings", "recompute")}


def _package(module: str) -> str:
    """``zeal.zero.apply`` → ``zero``; ``zeal`` (the root) → ``zeal``; a module of ``UNITS``
    → its unit (``zeal.moe.layer`` → ``moe.layer``)."""
    if module in UNITS:
        return UNITS[module]
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
                (p.is_dir() and any(p.glob("*.py")))} | {"zeal"} | set(UNITS.values())
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
    # the check: not even a docstring names it (`grep -rn "zeal.cli" zeal | grep -v ^zeal/cli/`)
    named = [str(p.relative_to(ROOT.parent)) for p in ROOT.rglob("*.py")
             if p.parent.name != "cli" and "zeal.cli" in p.read_text()]
    assert not named, named


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


# -- no import cycles between zeal modules ---------------------------------------------------
# A cycle hides a dependency direction (which module is the lower one?) even inside a package,
# and a lazy import only hides it from the interpreter. Every import counts, as above; an
# allowed cycle would be listed with its way out, and the list may only shrink (it is empty).
ALLOWED_CYCLES: dict[frozenset[str], str] = {}  # none left: the last three were broken in the fifth session


@functools.cache
def module_edges(module: str, root: Path) -> frozenset[str]:
    """The zeal modules ``module`` imports anywhere in its file (lazy ones, ``TYPE_CHECKING``
    and a package's ``__getattr__`` included): ``from P import n`` names ``P.n`` when that is
    a module, else ``P``."""
    path = _source(module, root)
    if path is None:
        return frozenset()
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                pkg = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                pkg = node.module or ""
            out |= {f"{pkg}.{a.name}" if _source(f"{pkg}.{a.name}", root) else pkg for a in node.names}
    return frozenset(m for m in out if (m == "zeal" or m.startswith("zeal.")) and m != module
                     and _source(m, root) is not None)


def import_cycles(root: Path = ROOT) -> set[frozenset[str]]:
    """The groups of zeal modules that import each other, directly or round a circle."""
    mods = [_module_name(p, root) for p in sorted(root.rglob("*.py"))]
    reach: dict[str, set[str]] = {}
    for m in mods:
        seen, todo = set(), [m]
        while todo:
            for t in module_edges(todo.pop(), root):
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        reach[m] = seen
    return {frozenset({m} | {o for o in reach[m] if m in reach.get(o, ())}) for m in mods if m in reach[m]}


def test_no_new_import_cycle():
    new = sorted(sorted(c) for c in import_cycles() - set(ALLOWED_CYCLES))
    assert not new, ("zeal modules that import each other (lazy imports included); move what both need "
                     "into a module below them:\n" + "\n".join(" <-> ".join(c) for c in new))


def test_allowed_cycles_only_shrink():
    stale = [sorted(c) for c in set(ALLOWED_CYCLES) - import_cycles()]
    assert not stale, f"these cycles are gone: remove them from ALLOWED_CYCLES: {stale}"


def test_a_lazy_cycle_inside_a_package_fails(tmp_path):
    """The old models/hf.py <-> models/llama.py shape: a module-level import one way, a lazy
    one back (the scanner can fail), and a third module that only imports one of them."""
    pkg = tmp_path / "zeal" / "models"
    pkg.mkdir(parents=True)
    (tmp_path / "zeal" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from zeal.models.llama import Llama\n")
    (pkg / "hf.py").write_text("from zeal.models.llama import Llama\n")
    (pkg / "llama.py").write_text("class Llama:\n    def load(self):\n        from zeal.models import hf\n")
    (pkg / "gpt.py").write_text("from . import llama\n")
    assert import_cycles(tmp_path / "zeal") == {frozenset({"zeal.models.hf", "zeal.models.llama"})}


# -- the models rule ---------------------------------------------------------------------------
# DESIGN: the model stays a plain single-device nn.Module; tensor/pipeline parallelism, ZeRO,
# compression and the MoE apply-step are applied to it from above (policies, loaders and
# split rules are handed in). So nothing that models/ loads, directly or through what it
# imports, may be one of these, or anything above models in LAYERS.
MODELS_MAY_NOT_LOAD = ("parallel", "pipe", "zero", "compression", "moe", "precision", "data")


def _source(module: str, root: Path) -> Path | None:
    base = root.parent.joinpath(*module.split("."))
    return base / "__init__.py" if (base / "__init__.py").exists() else (
        base.with_suffix(".py") if base.with_suffix(".py").exists() else None)


@functools.cache
def _edges(module: str, root: Path) -> list[str]:
    """The modules importing ``module`` can load: every import statement, lazy ones included
    (``from P import n`` also names ``P.n`` when that is a module), except the body of a
    package's module-level ``__getattr__`` (PEP 562: it runs on attribute access only)."""
    path = _source(module, root)
    if path is None:
        return []
    tree = ast.parse(path.read_text())
    if path.name == "__init__.py":
        tree.body = [n for n in tree.body if not (isinstance(n, ast.FunctionDef) and n.name == "__getattr__")]
    out = []
    for target, _ in imports_of(ast.unparse(tree), module, path.name == "__init__.py"):
        out.append(target)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = imports_of(ast.unparse(ast.Module([node], [])), module, path.name == "__init__.py")
            for (pkg, _), alias in ((b, a) for b in base[:1] for a in node.names):
                if pkg != "zeal" and _source(f"{pkg}.{alias.name}", root) is not None:
                    out.append(f"{pkg}.{alias.name}")
    return out


def loaded_by(module: str, root: Path = ROOT) -> dict[str, str]:
    """Every zeal module that importing ``module`` (and calling its functions) can load →
    the module that imports it. Parent packages are run (their module-level imports count)
    but are not themselves counted: importing ``zeal.moe.layer`` runs ``zeal/moe/__init__.py``."""
    seen: dict[str, str] = {}
    todo, ran = [module], set()
    while todo:
        m = todo.pop()
        if m in ran:
            continue
        ran.add(m)
        parts = m.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # the parents run first
        for target in _edges(m, root):
            if target not in seen and target != module:
                seen[target] = m
            todo.append(target)
    return seen


def models_violations(root: Path = ROOT) -> list[str]:
    layer = _layer_of()
    bad = []
    for path in sorted((root / "models").rglob("*.py")):
        start = _module_name(path, root)
        for target, via in sorted(loaded_by(start, root).items()):
            unit = _package(target)
            if unit != "models" and (unit in MODELS_MAY_NOT_LOAD or layer.get(unit, 99) >= layer["models"]):
                bad.append(f"{start} loads {target} (imported by {via})")
    return bad


def test_models_know_no_parallelism():
    """models/ loads none of parallel, pipe, zero, compression, moe's apply side (nor any
    package at or above its layer), lazy imports and package __init__s included."""
    bad = models_violations()
    assert not bad, "model code must stay plain (inject from the apply-steps instead):\n" + "\n".join(bad)


def test_the_models_rule_can_fail(tmp_path):
    """A lazy import of the TP apply-step, and a layer module whose package __init__ pulls
    the apply side at import: both found; a lazy re-export in __getattr__ is not."""
    pkg = tmp_path / "zeal"
    for name in ("models", "moe", "parallel", "dist"):
        (pkg / name).mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "dist" / "__init__.py").write_text("")
    (pkg / "parallel" / "__init__.py").write_text("")
    (pkg / "parallel" / "tensor.py").write_text("")
    (pkg / "moe" / "layer.py").write_text("from zeal.dist import x\n")
    (pkg / "moe" / "apply.py").write_text("")
    (pkg / "models" / "__init__.py").write_text("")
    (pkg / "models" / "block.py").write_text("from zeal.moe.layer import MoE\n")
    (pkg / "models" / "tp.py").write_text("def f():\n    from zeal.parallel import tensor\n")
    (pkg / "moe" / "__init__.py").write_text("def __getattr__(n):\n    from zeal.moe import apply\n")
    assert models_violations(pkg) == ["zeal.models.tp loads zeal.parallel (imported by zeal.models.tp)",
                                      "zeal.models.tp loads zeal.parallel.tensor (imported by zeal.models.tp)"]
    (pkg / "moe" / "__init__.py").write_text("from zeal.moe.apply import apply_moe\n")
    _edges.cache_clear()  # the file changed
    assert "zeal.models.block loads zeal.moe.apply (imported by zeal.moe)" in models_violations(pkg)


@pytest.mark.timeout(60)
def test_importing_the_models_loads_no_parallelism():
    """The same rule at run time: a fresh interpreter that imports every models module."""
    import subprocess
    import sys

    mods = [_module_name(p, ROOT) for p in sorted((ROOT / "models").rglob("*.py"))]
    code = f"import sys\nfor m in {mods!r}:\n    __import__(m)\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50,
                         cwd=ROOT.parent, check=True).stdout.split()
    layer = _layer_of()
    loaded = {m for m in out if m.startswith("zeal.") and m not in ("zeal.moe",)}
    assert not [m for m in loaded if _package(m) in MODELS_MAY_NOT_LOAD or layer[_package(m)] >= layer["models"]
                and _package(m) != "models"]
    assert "zeal.models.hf" in loaded and "zeal.moe.layer" in loaded  # the check saw the imports


# -- private state stays in its package -------------------------------------------------------
# A package changes another package's objects through their public methods and attributes:
# ``obj._name = ...`` (or ``+=``) outside ``self`` is a write into another object's internals,
# and so is ``obj._name.x = ...``; both are refused when ``_name`` is private state a class of
# ANOTHER zeal package sets on itself (``self._name = ...``), e.g. checkpoint/load.py's old
# ``engine._boundary_start = ...`` and the DeepSpeed facade's old ``engine._p.grad_accum = ...``.
# torch's and transformers' own private hooks (``module._parameters``, ``config._attn_implementation``)
# are no zeal package's state and are not counted.
def _private_writes(root: Path) -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """(package → the private attributes its classes set on ``self``, [(package, attribute,
    where)] of every private attribute written on another object)."""
    own: dict[str, set[str]] = {}
    foreign: list[tuple[str, str, str]] = []
    for path in sorted(root.rglob("*.py")):
        pkg = _package(_module_name(path, root))
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in (e for tt in targets for e in (tt.elts if isinstance(tt, ast.Tuple) else [tt])):
                first = True
                while isinstance(t, (ast.Attribute, ast.Subscript)):  # a.b._c.d[k] = ...: each link
                    if isinstance(t, ast.Attribute) and t.attr.startswith("_") and not t.attr.startswith("__"):
                        if isinstance(t.value, ast.Name) and t.value.id in ("self", "cls"):
                            if first:
                                own.setdefault(pkg, set()).add(t.attr)
                        else:
                            foreign.append((pkg, t.attr, f"{path.relative_to(root.parent)}:{node.lineno}"))
                    first, t = False, t.value
    return own, foreign


def cross_package_private_writes(root: Path = ROOT) -> list[str]:
    own, foreign = _private_writes(root)
    return [f"{where}: writes {attr}, private state of {', '.join(sorted(p for p in own if attr in own[p] and p != pkg))}"
            for pkg, attr, where in foreign if any(attr in names for p, names in own.items() if p != pkg)]


def test_no_package_writes_another_packages_private_state():
    bad = cross_package_private_writes()
    assert not bad, "give the owner a public method instead:\n" + "\n".join(bad)


def test_a_cross_package_private_write_fails(tmp_path):
    pkg = tmp_path / "zeal"
    for name in ("train", "checkpoint"):
        (pkg / name).mkdir(parents=True)
    (pkg / "train" / "engine.py").write_text("class E:\n    def __init__(self):\n        self._start = 0\n")
    (pkg / "checkpoint" / "load.py").write_text(
        "def load(engine, m):\n    engine.steps, engine._start = m, m\n    engine.module._parameters = {}\n"
        "    engine._start.x[0] = m\n    self._start = m\n")
    assert cross_package_private_writes(pkg) == ["zeal/checkpoint/load.py:2: writes _start, private state of train",
                                                 "zeal/checkpoint/load.py:4: writes _start, private state of train"]
