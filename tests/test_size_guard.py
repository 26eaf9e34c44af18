"""Size guard: no module in zeal/ over 600 lines and no function over 100 lines
(measured with ``ast``: a function from its ``def`` (decorators included) to its
last line). C++ kernels are not Python and not measured. Each exception is named
below with the reason; anything that can be split is split instead."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)
PACKAGE = Path(__file__).resolve().parents[1] / "zeal"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 100

# "path/to/module.py" or "path/to/module.py:qualified.name" -> why it may be larger
ALLOWED: dict[str, str] = {}


def _functions(tree: ast.AST, prefix: str = ""):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            yield prefix + node.name, node.end_lineno - start + 1
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")


def _measure() -> tuple[dict[str, int], dict[str, int]]:
    modules, functions = {}, {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        text = path.read_text()
        modules[rel] = len(text.splitlines())
        for name, n in _functions(ast.parse(text, filename=str(path))):
            functions[f"{rel}:{name}"] = n
    return modules, functions


def test_no_module_or_function_is_too_long():
    modules, functions = _measure()
    too_big = [f"{k} ({n} lines)" for k, n in modules.items() if n > MAX_MODULE_LINES and k not in ALLOWED]
    too_big += [f"{k} ({n} lines)" for k, n in functions.items() if n > MAX_FUNCTION_LINES and k not in ALLOWED]
    assert not too_big, (f"over {MAX_MODULE_LINES} lines a module / {MAX_FUNCTION_LINES} a function; split it "
                         f"(or name it in ALLOWED with the reason): {too_big}")


def test_the_allow_list_names_only_real_offenders():
    """An entry whose module or function is gone or back under the limit must be removed."""
    modules, functions = _measure()
    stale = [k for k in ALLOWED
             if (k in modules and modules[k] <= MAX_MODULE_LINES)
             or (k in functions and functions[k] <= MAX_FUNCTION_LINES)
             or (k not in modules and k not in functions)]
    assert not stale, f"remove from ALLOWED: {stale}"
