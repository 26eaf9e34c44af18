"""How much of DeepSpeed's public surface zeal's ``deepspeed`` has: implemented / refused / missing.

DeepSpeed's names are in ``zeal/deepspeed/ds_0_19_8_names.json``: the public names of
``dir(deepspeed)`` and of ``dir(deepspeed.DeepSpeedEngine)`` for DeepSpeed 0.19.8.
``--from-installed``, run with DeepSpeed's own Python (``DS_ACCELERATOR=cpu
/work/peers/ds/bin/python bench/compat/ds_surface.py --from-installed``), regenerates the
file from DeepSpeed's ``dir()`` after ``import deepspeed``; ``--from-sdist
deepspeed-0.19.8.tar.gz`` reads the same from its source without installing it. Of
``dir(deepspeed)`` the names that are DeepSpeed's count (its modules, classes, functions
and values); what ``deepspeed/__init__.py`` merely imports from elsewhere (``torch``,
``os``, ``typing.Optional``, ``torch.optim.Optimizer``) does not. The engine's names are
split into those ``torch.nn.Module`` has too (inherited or overridden: ``train``,
``forward``, ...) and DeepSpeed's own.

For each name, zeal's side (``zeal.deepspeed`` / ``zeal.deepspeed.DeepSpeedEngine``):
**implemented** (a real attribute), **refused** (it raises one line naming the DeepSpeed
API and what to use in zeal instead) or **missing** (it raises a generic one-line
"not implemented by zeal", with no alternative named). Run:
``python bench/compat/ds_surface.py [--list]``.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import tarfile
from pathlib import Path

NAMES = Path(__file__).resolve().parents[2] / "zeal" / "deepspeed" / "ds_0_19_8_names.json"


def _public(name: str) -> bool:
    return not name.startswith("_")


def names_from_sdist(sdist: str) -> dict:
    """DeepSpeed's top-level and engine public names, read from its source tarball."""
    import torch

    with tarfile.open(sdist) as tar:
        files = {m.name.split("/", 1)[1]: m for m in tar.getmembers() if m.isfile() and "/" in m.name}

        def src(path: str) -> str:
            return tar.extractfile(files[path]).read().decode()

        top: set[str] = set()
        tree = ast.parse(src("deepspeed/__init__.py"))
        for node in tree.body:  # module level only: what dir(deepspeed) shows after import
            if isinstance(node, ast.ImportFrom) and node.level >= 1:
                top.update(a.asname or a.name for a in node.names)
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                top.add(node.name)
            elif isinstance(node, ast.Assign):
                top.update(t.id for t in node.targets if isinstance(t, ast.Name))
        subpackages = {p.split("/")[1] for p in files if p.startswith("deepspeed/") and p.count("/") == 2
                       and p.endswith("/__init__.py")}
        top |= subpackages
        engine: set[str] = set()
        for node in ast.walk(ast.parse(src("deepspeed/runtime/engine.py"))):
            if isinstance(node, ast.ClassDef) and node.name == "DeepSpeedEngine":
                engine = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
                engine |= {t.id for n in node.body if isinstance(n, ast.Assign) for t in n.targets
                           if isinstance(t, ast.Name)}
    module_names = {n for n in dir(torch.nn.Module) if _public(n)}
    return {"deepspeed_version": "0.19.8",
            "source": "AST of deepspeed/__init__.py and DeepSpeedEngine in deepspeed/runtime/engine.py "
                      "(DeepSpeed 0.19.8 sdist); engine names inherited from torch.nn.Module listed apart; "
                      "modules: every deepspeed/**/*.py of the sdist as a dotted name",
            "top_level": sorted(n for n in top if _public(n)),
            "modules": sorted({p[:-3].removesuffix("/__init__").replace("/", ".") for p in files
                               if p.startswith("deepspeed/") and p.endswith(".py")}),
            "engine": sorted(n for n in engine if _public(n)),
            "engine_from_nn_module": sorted(module_names)}


def names_from_installed() -> dict:
    """DeepSpeed's top-level and engine public names from ``dir()`` of the installed
    DeepSpeed (run with DeepSpeed's Python; zeal is not imported)."""
    import os
    import types
    import typing

    import deepspeed
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine

    def deepspeeds(name: str, obj: object) -> bool:
        if isinstance(obj, types.ModuleType):
            return obj.__name__.startswith("deepspeed")
        if hasattr(typing, name) and obj is getattr(typing, name):  # `from typing import Optional`
            return False
        if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)):  # where it is defined
            return str(getattr(obj, "__module__", "") or "").startswith("deepspeed")
        return True  # a value deepspeed/__init__.py sets (version, a constant, logger, a type alias)

    top = [n for n in dir(deepspeed) if _public(n) and deepspeeds(n, getattr(deepspeed, n))]
    module_names = {n for n in dir(torch.nn.Module) if _public(n)}
    engine = {n for n in dir(DeepSpeedEngine) if _public(n)}
    root = Path(deepspeed.__file__).parent
    modules = {("deepspeed/" + str(p.relative_to(root)))[:-3].removesuffix("/__init__").replace(os.sep, ".")
               .replace("/", ".") for p in root.rglob("*.py")}
    return {"deepspeed_version": deepspeed.__version__,
            "source": "dir(deepspeed) and dir(deepspeed.runtime.engine.DeepSpeedEngine) of the installed DeepSpeed "
                      "(DS_ACCELERATOR=cpu), public names; top level: DeepSpeed's own modules, classes, functions "
                      "and values; engine names torch.nn.Module also has listed apart; modules: every "
                      "deepspeed/**/*.py as a dotted name",
            "top_level": sorted(top), "modules": sorted(modules),
            "engine": sorted(engine - module_names), "engine_from_nn_module": sorted(engine & module_names)}


def classify(obj: object, name: str) -> str:
    """implemented / refused / missing for ``getattr(obj, name)`` (a module's names; the
    engine's are classified by ``DeepSpeedEngine.surface``, which also knows the names
    it forwards to zeal's engine per instance)."""
    from zeal.deepspeed.refusals import Refused

    try:
        getattr(obj, name)
    except Refused as e:
        return "missing" if e.generic else "refused"
    except Exception:  # noqa: BLE001 - anything else is not a working attribute
        return "missing"
    return "implemented"


def count(names: dict) -> dict:
    import zeal.deepspeed as ds

    engine_cls = ds.DeepSpeedEngine
    out: dict = {}
    for section, obj, keys in (("top_level", ds, names["top_level"]),
                               ("engine", engine_cls, names["engine"]),
                               ("engine_from_nn_module", engine_cls, names["engine_from_nn_module"])):
        table: dict[str, list[str]] = {"implemented": [], "refused": [], "missing": []}
        for n in keys:
            table[obj.surface(n) if obj is engine_cls else classify(obj, n)].append(n)
        out[section] = table
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--from-sdist", help="regenerate the names file from DeepSpeed's sdist")
    ap.add_argument("--from-installed", action="store_true",
                    help="regenerate the names file from the installed DeepSpeed's dir() (DeepSpeed's Python)")
    ap.add_argument("--list", action="store_true", help="list the names in each class")
    args = ap.parse_args(argv)
    if args.from_sdist or args.from_installed:
        names = names_from_installed() if args.from_installed else names_from_sdist(args.from_sdist)
        NAMES.write_text(json.dumps(names, indent=1) + "\n")
        print(f"wrote {NAMES}: {len(names['top_level'])} top-level, {len(names['engine'])} engine, "
              f"{len(names['engine_from_nn_module'])} engine names nn.Module has too")
        if args.from_installed:
            return 0  # counted with zeal's Python
    names = json.loads(NAMES.read_text())
    result = count(names)
    print(f"DeepSpeed {names['deepspeed_version']} public names on zeal.deepspeed")
    print(f"{'':24} {'total':>6} {'implemented':>12} {'refused':>8} {'missing':>8}")
    for section, table in result.items():
        total = sum(len(v) for v in table.values())
        print(f"{section:24} {total:>6} {len(table['implemented']):>12} {len(table['refused']):>8} "
              f"{len(table['missing']):>8}")
    if args.list:
        for section, table in result.items():
            for kind, items in table.items():
                print(f"\n{section} {kind} ({len(items)}): {' '.join(items)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.exit(main())
