"""Which torch names and keywords zeal uses are missing from the torch this Python runs.

    python bench/gpu/torch_api_check.py [zeal bench ...]   # exit 1 when something is missing

The GPU image carries another torch than the one zeal is developed on; a name or keyword
that exists only in the newer one crashes the GPU run on the one branch the CPU tests never
take. This reads the sources (AST, no import of zeal), follows each file's torch imports
and aliases (``import torch.distributed as dist``, ``from torch.nn import functional as F``),
and checks against the running torch that every dotted name resolves and every keyword
given to a torch function with a Python signature is one of its parameters. It does not see
attributes of objects (``tensor.foo()``) nor names built at run time: the tests under that
torch cover those.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MISSING = object()
OPTIONAL = ("torch.utils.tensorboard",)  # optional extras that need a package torch does not carry


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> the torch dotted name it stands for, from the file's imports."""
    alias = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    alias[a.asname or "torch"] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            for a in node.names:
                alias[a.asname or a.name] = f"{node.module}.{a.name}"
    return alias


def _dotted(node: ast.AST, alias: dict[str, str]) -> str | None:
    chain = []
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in alias:
        return ".".join([alias[node.id], *reversed(chain)])
    return None


def _resolve(name: str) -> object:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            continue
    else:
        return MISSING
    for p in parts[i:]:
        obj = getattr(obj, p, MISSING)
        if obj is MISSING:
            return MISSING
    return obj


def check(roots: list[Path]) -> list[str]:
    """One line per missing name or keyword: ``file:line what``."""
    names: dict[str, str] = {}  # dotted name -> first place used
    calls: list[tuple[str, str, str]] = []  # (callee, keyword, place)
    for root in roots:
        for f in sorted(root.rglob("*.py")):
            tree = ast.parse(f.read_text(), str(f))
            alias = _aliases(tree)
            where = f.relative_to(REPO) if f.is_relative_to(REPO) else f
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
                    for a in node.names:
                        names.setdefault(f"{node.module}.{a.name}", f"{where}:{node.lineno}")
                elif isinstance(node, ast.Attribute) and (full := _dotted(node, alias)):
                    names.setdefault(full, f"{where}:{node.lineno}")
                elif isinstance(node, ast.Call) and (full := _dotted(node.func, alias)):
                    calls += [(full, k.arg, f"{where}:{node.lineno}") for k in node.keywords if k.arg]
    out = [f"{place} {name}: not in this torch" for name, place in sorted(names.items())
           if not name.startswith(OPTIONAL) and _resolve(name) is MISSING]
    for callee, kw, place in calls:
        obj = _resolve(callee)
        if obj is MISSING or not callable(obj):
            continue
        try:
            params = inspect.signature(obj).parameters
        except (TypeError, ValueError):  # a builtin without a Python signature
            continue
        if kw not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            out.append(f"{place} {callee}({kw}=...): no such parameter in this torch")
    return out


def main(argv: list[str] | None = None) -> int:
    import torch

    warnings.simplefilter("ignore")
    roots = [REPO / r for r in (argv or ["zeal", "bench"])]
    missing = check(roots)
    print("\n".join(missing) if missing else f"torch {torch.__version__}: every torch name and keyword "
          f"used in {', '.join(str(r.relative_to(REPO)) for r in roots)} exists")
    return 1 if missing else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
