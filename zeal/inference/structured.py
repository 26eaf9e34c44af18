"""Structured outputs: grammars that constrain sampling, through llguidance (optional extra
``structured``: ``pip install zeal[structured]``).

A request's :class:`StructuredOutputsParams` (vLLM's name) holds one constraint: a JSON
schema (``json``), any JSON object (``json_object``), a regular expression (``regex``) or
a Lark grammar (``grammar``). Each sequence that carries one gets its own matcher; before
every draw the matcher's mask of allowed next tokens sets the others' logits to -inf (so
greedy and sampled draws, penalties and truncation all see only allowed tokens), and the
drawn token then advances the matcher. When the grammar is complete and nothing may follow,
the sequence ends with ``finish_reason="stop"``; when it is complete but may go on (an
accepting state), end-of-sequence is among the allowed tokens.

JSON is generated compact (no optional whitespace) unless the schema's ``x-guidance``
says otherwise: bounded schemas then give bounded outputs.

A constraint that is wrong is the client's mistake wherever it shows: a wrongly typed
field, a grammar that does not compile, or one that admits no output at all (a ``$ref``
cycle, ``{"$ref": "#"}``), found when compiling or at a later mask, raises
:class:`GrammarError` (a ``ValueError``: HTTP 400) with one line naming it, never
llguidance's internal state.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from zeal.inference.tokenizer import Tokenizer

JSON_DEFAULTS = {"whitespace_flexible": False}
_STOP_REASONS = {  # llguidance's reasons for a matcher that cannot go on, in words
    "NoExtension": "the constraint admits no further output",
    "NoExtensionBias": "the constraint admits no output (a $ref cycle, or a schema nothing can match?)",
    "LexerTooComplex": "the constraint is too complex (its lexer grew past llguidance's limits)",
    "ParserTooComplex": "the constraint is too complex (its parser grew past llguidance's limits)",
}


class GrammarError(ValueError):
    """A structured-outputs constraint that cannot be used (the request's mistake)."""


def one_line(error: str, limit: int = 300) -> str:
    """llguidance's error text as one line: its message, without the state dump that may follow."""
    text = error.split("<state>", 1)[0].strip()
    first = text.splitlines()[0].strip() if text else ""
    if first in _STOP_REASONS:
        return _STOP_REASONS[first]
    msg = " ".join(text.split())  # a regex error's caret lines folded in
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint: ``json`` (a JSON schema, dict or string), ``json_object``
    (any JSON object), ``regex`` or ``grammar`` (Lark syntax, as llguidance reads it)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [n for n, v in (("json", self.json), ("json_object", self.json_object or None),
                                ("regex", self.regex), ("grammar", self.grammar)) if v is not None]
        if len(given) != 1:
            raise GrammarError(f"structured outputs take exactly one of json, json_object, regex, grammar; got "
                               f"{', '.join(given) or 'none'}")
        for name, kind in (("regex", str), ("grammar", str), ("json_object", bool), ("json", (dict, str))):
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                what = {"regex": "a string", "grammar": "a string (Lark)", "json_object": "a boolean",
                        "json": "a JSON schema object"}[name]
                raise GrammarError(f"structured outputs: {name} must be {what}, got {type(value).__name__}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise GrammarError(f"structured outputs: json is not a valid JSON schema document: {e}") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise GrammarError("structured outputs: json must be a JSON schema object")
        if self.json is not None and (cycle := ref_cycle(self.json)):
            raise GrammarError(f"structured outputs: json: $ref cycle {' -> '.join(cycle)} (nothing can match it)")

    def grammar_text(self) -> str:
        """The llguidance grammar of the constraint."""
        import llguidance

        M = llguidance.LLMatcher
        if self.json is not None:
            return M.grammar_from_json_schema(self.json, defaults=JSON_DEFAULTS)
        if self.json_object:
            return M.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
        if self.regex is not None:
            return M.grammar_from_regex(self.regex)
        return M.grammar_from_lark(self.grammar)


_PURE_REF_KEYS = {"$ref", "$defs", "definitions", "$schema", "$id", "$comment", "title", "description"}


def ref_cycle(schema: dict) -> list[str] | None:
    """The first chain of local ``$ref`` that comes back to itself through schemas that are
    nothing but a reference (``{"$ref": "#"}``, ``a -> b -> a``), or None. Walks the schema
    without recursion (it may be nested deeply)."""

    def resolve(ref: str):
        node = schema
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def pure_ref(node) -> str | None:
        if isinstance(node, dict) and not set(node) - _PURE_REF_KEYS:
            ref = node.get("$ref")
            if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
                return ref
        return None

    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            chain: list[str] = []
            target = node
            while (ref := pure_ref(target)) is not None:
                if ref in chain:
                    return chain[chain.index(ref):] + [ref]
                chain.append(ref)
                target = resolve(ref)
            stack.extend(v for v in node.values() if isinstance(v, dict | list))  # each node walked once
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, dict | list))
    return None


def _require_llguidance():
    try:
        import llguidance
    except ImportError:
        raise ValueError("structured outputs need llguidance: pip install 'zeal[structured]'") from None
    return llguidance


class GrammarCompiler:
    """Matchers for one engine's tokenizer (its token bytes read once, on first use)."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, list(eos_token_ids)
        self._ll = None

    def _ll_tokenizer(self):
        llguidance = _require_llguidance()
        if self._ll is None:
            tok = self.tokenizer
            if tok is None:
                raise ValueError("structured outputs need the model's tokenizer")
            if not self.eos:
                raise ValueError("structured outputs need an end-of-sequence token")
            self._ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenTable(tok, self.eos)),
                                              n_vocab=self.vocab_size, eos_token=self.eos)
        return self._ll

    def matcher(self, params: StructuredOutputsParams) -> Any:
        """A fresh matcher whose first mask is computed: :class:`GrammarError` naming the
        problem in one line for a grammar that does not compile or admits no output."""
        llguidance = _require_llguidance()
        try:
            text = params.grammar_text()
        except Exception as e:  # noqa: BLE001 - whatever the client's constraint makes llguidance raise
            raise GrammarError(f"structured outputs: {one_line(str(e))}") from None
        ll = self._ll_tokenizer()
        try:
            m = llguidance.LLMatcher(ll, text, log_level=0)
        except Exception as e:  # noqa: BLE001 - as above
            raise GrammarError(f"structured outputs: the grammar does not compile: {one_line(str(e))}") from None
        if m.is_error():
            raise GrammarError(f"structured outputs: the grammar does not compile: {one_line(m.get_error())}")
        m.compute_bitmask()  # the first mask: a grammar that admits nothing says so here, before any pass
        check(m)
        return m


class _TokenTable:
    """What llguidance's TokenizerWrapper reads: every token's bytes (special tokens, the
    end-of-sequence ids among them, as 0xFF + their name: llguidance's convention, which
    keeps them out of the text a grammar matches), their ids, and encoding."""

    def __init__(self, tok: Tokenizer, eos: list[int]) -> None:
        special = {i for i, a in tok.tok.get_added_tokens_decoder().items() if a.special} | set(eos)
        n = tok.tok.get_vocab_size(with_added_tokens=True)
        self.tokens = [b"\xff" + (tok.tok.id_to_token(i) or "").encode() if i in special
                       else bytes(tok.token_bytes(i)) for i in range(n)]
        self.special_token_ids = sorted(special)
        self.eos_token_id, self.bos_token_id = eos[0], None
        self._tok = tok

    def __call__(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)


def check(matcher: Any) -> None:
    """:class:`GrammarError` (one line) when the matcher has failed (after a mask or a token)."""
    if matcher.is_error():
        raise GrammarError(f"structured outputs: {one_line(matcher.get_error())}")


def allowed_mask(matcher: Any, vocab_size: int) -> torch.Tensor:
    """``(vocab_size,)`` bool: the tokens the matcher allows next."""
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    out = np.zeros(vocab_size, dtype=bool)
    n = min(vocab_size, bits.size)
    out[:n] = bits[:n].astype(bool)
    return torch.from_numpy(out)


def grammar_masks(matchers: list[Any], vocab_size: int) -> list[torch.Tensor | GrammarError | None]:
    """Per row: the allowed-token mask of its matcher, None without one, or the
    :class:`GrammarError` of a matcher that fails here (a mask that allows nothing included)."""
    out: list[torch.Tensor | GrammarError | None] = []
    for m in matchers:
        if m is None:
            out.append(None)
            continue
        try:
            mask = allowed_mask(m, vocab_size)
            check(m)
            if not bool(mask.any()):
                raise GrammarError("structured outputs: the constraint allows no token here")
            out.append(mask)
        except GrammarError as e:
            out.append(e)
    return out


def mask_rows(logits: torch.Tensor, masks: list[torch.Tensor | None]) -> torch.Tensor:
    """``logits (S, V)`` with the disallowed tokens of row ``i`` at -inf, for the rows with a
    mask (a copy when any row is masked)."""
    rows = [i for i, m in enumerate(masks) if m is not None]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        logits[i].masked_fill_(~masks[i], float("-inf"))
    return logits


# keys whose value is a map of names to subschemas, a list of subschemas, or one subschema
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalItems", "additionalProperties", "contains", "propertyNames", "not", "if",
               "then", "else", "unevaluatedItems", "unevaluatedProperties")


def close_objects(schema: dict) -> dict:
    """A copy of the JSON schema ``schema`` in which every object schema that declares
    ``properties`` but says nothing of other keys (no ``additionalProperties``,
    ``patternProperties`` or ``unevaluatedProperties``) gets ``additionalProperties: false``.

    Clients write schemas that way (pydantic's ``model_json_schema()``, LangChain's
    ``bind_tools``, instructor) and mean "these keys": left open, a constrained answer may add
    any number of extra keys, the same key twice included. Members of ``allOf`` are left as
    they are (closing each part would reject the keys of the others). An explicit
    ``additionalProperties`` is kept. Walks without recursion (schemas may nest deeply)."""
    root = dict(schema)
    stack: list[tuple[dict, bool]] = [(root, True)]
    while stack:
        node, closable = stack.pop()
        if (closable and isinstance(node.get("properties"), dict)
                and not {"additionalProperties", "patternProperties", "unevaluatedProperties"} & set(node)):
            node["additionalProperties"] = False
        for key, value in list(node.items()):
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                node[key] = {k: _push(stack, v, True) for k, v in value.items()}
            elif key in _SCHEMA_LISTS and isinstance(value, list):
                node[key] = [_push(stack, v, key != "allOf") for v in value]
            elif key in _SCHEMA_ONE and isinstance(value, dict):
                node[key] = _push(stack, value, True)
    return root


def _push(stack: list[tuple[dict, bool]], node, closable: bool):
    if not isinstance(node, dict):
        return node
    copy = dict(node)
    stack.append((copy, closable))
    return copy
