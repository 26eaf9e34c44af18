"""Dotted command-line overrides (``--model.n_layer 8``) and config-file loading for the CLI."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any


class UsageError(ValueError):
    """A wrong flag or value on the command line; the message names it."""


def parse_value(text: str) -> Any:
    """``"8"`` → 8, ``"1e-3"`` → 0.001, ``"true"`` → True, ``"[1,2]"`` → [1, 2], else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    try:
        return float(text)
    except ValueError:
        return text


def parse_dotted(tokens: list[str]) -> list[tuple[list[str], Any]]:
    """``["--model.n_layer", "8", "--job.steps=20"]`` → ``[(["model", "n_layer"], 8), (["job", "steps"], 20)]``.

    Dashes in key names become underscores. Raises UsageError for anything that is
    not a ``--key value`` pair."""
    out: list[tuple[list[str], Any]] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if not tok.startswith("--") or len(tok) <= 2:
            raise UsageError(f"unexpected argument {tok!r}")
        key, eq, value = tok[2:].partition("=")
        if not eq:
            if i + 1 >= len(tokens) or (tokens[i + 1].startswith("--") and len(tokens[i + 1]) > 2):
                raise UsageError(f"flag --{key} needs a value")
            value = tokens[i + 1]
            i += 1
        i += 1
        path = [p.replace("-", "_") for p in key.split(".")]
        if any(not p for p in path):
            raise UsageError(f"malformed flag --{key}")
        out.append((path, parse_value(value)))
    return out


def set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    """``tree[path[0]][path[1]]... = value``, creating dicts on the way."""
    node = tree
    for i, key in enumerate(path[:-1]):
        nxt = node.setdefault(key, {})
        if not isinstance(nxt, dict):
            raise UsageError(f"--{'.'.join(path)}: '{'.'.join(path[: i + 1])}' is not a section")
        node = nxt
    node[path[-1]] = value


def load_mapping(path: str | Path) -> dict[str, Any]:
    """A JSON or YAML file holding a mapping."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--config {str(p)!r}: no such file")
    text = p.read_text()
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # noqa: BLE001 - parser errors vary by format
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UsageError(f"--config {str(p)!r} is not valid {p.suffix.lstrip('.') or 'JSON'}: {first}") from None
    if not isinstance(data, dict):
        raise UsageError(f"--config {str(p)!r} must hold a mapping at the top level")
    return copy.deepcopy(data)
