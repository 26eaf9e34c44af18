"""Built-in tools for multi-turn episodes (:mod:`zeal.rlhf.multiturn`): a calculator that
evaluates arithmetic safely (the expression is parsed, never ``eval``-ed: numbers, ``+ - *
/ // % **`` and parentheses only, with bounded sizes) and a retriever over a local text
file (passages ranked by word overlap). Each comes with its OpenAI tool spec, which the
chat template renders for the model."""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable
from pathlib import Path

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION = 200  # characters
MAX_MAGNITUDE = 10.0 ** 30  # |operands| and |results|; exponents at most 100


def safe_eval(expression: str) -> int | float:
    """The value of an arithmetic ``expression``; ``ValueError`` naming what is not allowed
    (names, calls, attributes, strings... anything but numbers and the operators above)."""
    if not isinstance(expression, str) or len(expression) > MAX_EXPRESSION:
        raise ValueError(f"an expression is a string of at most {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(b) > 100:
            raise ValueError("exponent too large (at most 100)")
        try:
            return _bounded(_BINARY[type(node.op)](a, b))
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
    raise ValueError(f"not allowed in an arithmetic expression: {type(node).__name__}")


def _bounded(x):
    if isinstance(x, complex) or abs(x) > MAX_MAGNITUDE:
        raise ValueError("number out of range")
    return x


def calculator(expression: str) -> str:
    """The calculator tool: the value of ``expression`` as text (integers without ``.0``),
    or ``error: ...``."""
    try:
        v = safe_eval(expression)
    except ValueError as e:
        return f"error: {e}"
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return str(v)


CALCULATOR_SPEC = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression (+, -, *, /, //, %, **, parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}

_WORD = re.compile(r"\w+")


class Retriever:
    """The retrieval tool over a local text file: passages are its blank-line-separated
    blocks (or lines, when it has no blank lines); :meth:`search` returns the ``k`` passages
    sharing the most distinct words with the query (ties: file order)."""

    def __init__(self, path: str | Path, k: int = 1) -> None:
        text = Path(path).read_text()
        blocks = [b.strip() for b in re.split(r"\n\s*\n", text) if b.strip()]
        if len(blocks) <= 1:
            blocks = [ln.strip() for ln in text.splitlines() if ln.strip()]
        if not blocks:
            raise ValueError(f"retrieval file {path} holds no text")
        self.passages, self.k = blocks, k
        self._words = [set(_WORD.findall(b.lower())) for b in blocks]

    def search(self, query: str, k: int | None = None) -> list[str]:
        q = set(_WORD.findall(str(query).lower()))
        ranked = sorted(range(len(self.passages)), key=lambda i: (-len(q & self._words[i]), i))
        return [self.passages[i] for i in ranked[: k or self.k]]

    def __call__(self, query: str) -> str:
        return "\n\n".join(self.search(query))


RETRIEVAL_SPEC = {"type": "function", "function": {
    "name": "search", "description": "Find the passage of the local document that best matches a query.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}


def builtin_tools(retrieval_file: str | Path | None = None) -> tuple[dict[str, Callable[..., str]], list[dict]]:
    """``(functions by name, OpenAI specs)`` of the calculator, and of the retriever over
    ``retrieval_file`` when given."""
    fns: dict[str, Callable[..., str]] = {"calculator": calculator}
    specs = [CALCULATOR_SPEC]
    if retrieval_file is not None:
        fns["search"] = Retriever(retrieval_file)
        specs.append(RETRIEVAL_SPEC)
    return fns, specs


TOOL_NAMES = ("calculator", "retrieval")


def select_tools(names: list[str], retrieval_file: str | Path | None = None
                 ) -> tuple[dict[str, Callable[..., str]], list[dict]]:
    """``(functions by name, OpenAI specs)`` of the built-in tools named in ``names``
    (``calculator``, ``retrieval``: the ``search`` function over ``retrieval_file``); a
    one-line ``ValueError`` for an unknown name or a retrieval tool without a readable file."""
    unknown = [n for n in names if n not in TOOL_NAMES]
    if unknown:
        raise ValueError(f"tools: unknown tool {unknown[0]!r} (known: {', '.join(TOOL_NAMES)})")
    fns: dict[str, Callable[..., str]] = {}
    specs: list[dict] = []
    if "calculator" in names:
        fns["calculator"], specs = calculator, [CALCULATOR_SPEC]
    if "retrieval" in names:
        if not retrieval_file or not Path(retrieval_file).is_file():
            raise ValueError(f"tools: 'retrieval' needs rlhf.retrieval_file naming a text file (got {retrieval_file!r})")
        fns["search"] = Retriever(retrieval_file)
        specs.append(RETRIEVAL_SPEC)
    return fns, specs
