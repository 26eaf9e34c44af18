"""Tokenizer and chat template of a model folder (``tokenizer.json`` via ``tokenizers``;
``tokenizer_config.json``'s ``chat_template`` rendered with a sandboxed jinja2)."""

from __future__ import annotations

import json
import os
from pathlib import Path


class Tokenizer:
    """Text <-> ids, end-of-sequence ids, and chat formatting."""

    def __init__(self, tokenizer, config: dict | None = None, eos_token_ids: list[int] | None = None) -> None:
        self.tok = tokenizer
        self.config = config or {}
        self.chat_template: str | None = self.config.get("chat_template")
        if isinstance(self.chat_template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default", next(iter(named.values()), None))
        self.bos_token = self._token_str(self.config.get("bos_token"))
        self.eos_token = self._token_str(self.config.get("eos_token"))
        eos = list(eos_token_ids or [])
        if self.eos_token is not None:
            tid = self.tok.token_to_id(self.eos_token)
            if tid is not None and tid not in eos:
                eos.append(tid)
        self.eos_token_ids = eos
        self._template = None

    @staticmethod
    def _token_str(t) -> str | None:
        return t.get("content") if isinstance(t, dict) else t

    @classmethod
    def from_folder(cls, path: str | os.PathLike) -> Tokenizer | None:
        """None when the folder has no ``tokenizer.json`` (token-id-only use)."""
        from tokenizers import Tokenizer as HFTokenizer

        p = Path(path)
        if not (p / "tokenizer.json").exists():
            return None
        cfg = json.loads((p / "tokenizer_config.json").read_text()) if (p / "tokenizer_config.json").exists() else {}
        if (p / "chat_template.jinja").exists() and not cfg.get("chat_template"):
            cfg["chat_template"] = (p / "chat_template.jinja").read_text()
        eos: list[int] = []
        for name in ("generation_config.json", "config.json"):
            if (p / name).exists():
                e = json.loads((p / name).read_text()).get("eos_token_id")
                eos.extend(x for x in (e if isinstance(e, list) else [e]) if x is not None and x not in eos)
        return cls(HFTokenizer.from_file(str(p / "tokenizer.json")), cfg, eos)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Tokenizer:
        """A bare ``tokenizer.json`` (no config: no chat template, no special-token names)."""
        from tokenizers import Tokenizer as HFTokenizer

        return cls(HFTokenizer.from_file(str(path)))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        bos = self.tok.token_to_id(self.bos_token) if self.bos_token else None
        if add_special_tokens and self.config.get("add_bos_token") and bos is not None and ids[:1] != [bos]:
            ids = [bos] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> list[int]:
        """The bytes one token stands for (OpenAI's ``bytes`` of a logprob): byte-level BPE
        pieces mapped back through GPT-2's byte alphabet, ``<0xNN>`` byte-fallback pieces as
        their byte, anything else (special tokens included) as the UTF-8 of its text. A token
        that is part of a multi-byte character keeps its own bytes, not U+FFFD."""
        piece = self.tok.id_to_token(token_id)
        if piece is None:
            return list(self.decode([token_id], skip_special_tokens=False).encode())
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return [int(piece[3:5], 16)]
            except ValueError:
                pass
        if type(self.tok.decoder).__name__ == "ByteLevel" and self.tok.token_to_id(piece) == token_id:
            table = _byte_level_inverse()
            if all(ch in table for ch in piece):
                return [table[ch] for ch in piece]
        return list(self.decode([token_id], skip_special_tokens=False).encode())

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        """The prompt text for a chat (``tools``: OpenAI tool specs, for templates that render
        them); a plain ``role: content`` format when the model has no template."""
        if not self.chat_template:
            lines = [f"{m['role']}: {m['content']}" for m in messages]
            return "\n".join(lines) + ("\nassistant:" if add_generation_prompt else "")
        if self._template is None:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(msg: str) -> None:
                raise TemplateError(msg)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
            self._template = env.from_string(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            tools=tools,
        )

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Render then tokenize; special tokens in the template text are recognised, none added."""
        return self.encode(self.render_chat(messages, tools=tools), add_special_tokens=False)


_BYTE_LEVEL: dict[str, int] = {}


def _byte_level_inverse() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for
    themselves, the other 68 are shifted to code points 256 and up, in byte order."""
    if not _BYTE_LEVEL:
        printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
        extra = 0
        for b in range(256):
            if b in printable:
                _BYTE_LEVEL[chr(b)] = b
            else:
                _BYTE_LEVEL[chr(256 + extra)] = b
                extra += 1
    return _BYTE_LEVEL
