"""Tool calls in chat completions (OpenAI's ``tools`` / ``tool_choice`` / ``tool_calls``).

The tools are handed to the model's chat template (as ``tools``). With ``tool_choice``
``"required"`` or a named function, the answer is constrained (structured outputs) to a
JSON object ``{"name": ..., "arguments": {...}}`` naming one of the allowed tools, with
arguments matching that tool's ``parameters`` schema, so the call always parses. With
``"auto"`` (the default when tools are given) the model answers freely and a call is
recognised when the answer is such an object, bare or between ``<tool_call>`` tags (the
Hermes/Qwen convention); otherwise the answer is plain content. ``"none"``: no calls.
"""

from __future__ import annotations

import json
import re
import uuid

_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def forced(tool_choice: str | dict | None) -> bool:
    """Whether the answer must be a call (``"required"`` or one named function)."""
    return tool_choice == "required" or isinstance(tool_choice, dict)


def allowed_tools(tools: list[dict], tool_choice: str | dict | None) -> list[dict]:
    """The ``function`` entries a call may name; ``ValueError`` for a choice naming none of them."""
    funcs = [t["function"] for t in tools]
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                             '"function": {"name": NAME}}')
        funcs = [f for f in funcs if f["name"] == name]
        if not funcs:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
    return funcs


def call_schema(funcs: list[dict]) -> dict:
    """The JSON schema of one call to any of ``funcs``. Each function's ``parameters`` schema
    moves whole under the root's ``$defs`` (as ``fn0``, ``fn1``, ...) and ``arguments`` refers
    to it, with its own local references (``#``, ``#/$defs/...``, ``#/definitions/...``:
    pydantic's shape) rewritten to point inside it, so they resolve as they did at its root."""
    defs, alts = {}, []
    for i, f in enumerate(funcs):
        params = f.get("parameters") or {"type": "object"}
        defs[f"fn{i}"] = _rebase_refs(params, f"#/$defs/fn{i}")
        alts.append({"type": "object", "properties": {"name": {"const": f["name"]},
                                                      "arguments": {"$ref": f"#/$defs/fn{i}"}},
                     "required": ["name", "arguments"], "additionalProperties": False})
    root = alts[0] if len(alts) == 1 else {"anyOf": alts}
    return root | {"$defs": defs}


def _rebase_refs(node, base: str):
    """A copy of the schema ``node`` whose local ``$ref`` (``#`` and ``#/...``) point under ``base``."""
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
                out[k] = base + v[1:]
            else:
                out[k] = _rebase_refs(v, base)
        return out
    if isinstance(node, list):
        return [_rebase_refs(v, base) for v in node]
    return node


def parse_tool_calls(text: str, funcs: list[dict]) -> list[dict] | None:
    """OpenAI ``tool_calls`` from an answer that is one call object (or several between
    ``<tool_call>`` tags) naming known tools; None when the answer is not a call."""
    names = {f["name"] for f in funcs}
    pieces = _TAGGED.findall(text) if "<tool_call>" in text else [text.strip()]
    calls = []
    for piece in pieces:
        try:
            obj = json.loads(piece)
        except json.JSONDecodeError:
            return None
        args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
        if not isinstance(obj, dict) or obj.get("name") not in names or not isinstance(args, (dict, str)):
            return None
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}})
    return calls or None
