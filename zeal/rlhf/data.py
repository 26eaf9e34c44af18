"""RLHF data: JSONL rows into token ids. ``messages`` (SFT), ``prompt``/``chosen``/``rejected``
(RM, DPO), ``prompt`` (PPO, GRPO); texts go through the tokenizer (prompts through the
chat template), and token-id lists are taken as they are (models without a tokenizer)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from zeal.inference.tokenizer import Tokenizer
from zeal.rlhf.common import encode_prompt
from zeal.rlhf.config import RLHFConfig

log = logging.getLogger("zeal.rlhf")


def read_jsonl(path: str | Path, keys: tuple[str, ...], answer: bool = False) -> list[dict]:
    """The rows of a JSONL file; each must hold ``keys``, each of the type a job reads
    (:func:`row_problem`; ``answer``: an ``answer`` key, when present, is checked too).
    Every row is checked before any is used: a bad one is one clear error naming the file,
    the line and the key. Degenerate preference pairs (an empty answer, or ``chosen`` the
    same as ``rejected``) are warned about, once for the file."""
    rows = []
    try:
        text = Path(path).read_text()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    degenerate: list[int] = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not JSON ({e.msg})") from None
        except RecursionError:
            raise ValueError(f"{path}:{i}: not JSON (nested too deeply)") from None
        missing = [k for k in keys if not isinstance(row, dict) or k not in row]
        if missing:
            raise ValueError(f"{path}:{i}: missing key(s) {', '.join(missing)} (this job reads {', '.join(keys)})")
        bad = row_problem(row, keys + (("answer",) if answer and "answer" in row else ()))
        if bad:
            raise ValueError(f"{path}:{i}: {bad}")
        if "chosen" in keys and "rejected" in keys and (
                not row["chosen"] or not row["rejected"] or row["chosen"] == row["rejected"]):
            degenerate.append(i)
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows")
    if degenerate:
        shown = ", ".join(map(str, degenerate[:5])) + (", ..." if len(degenerate) > 5 else "")
        log.warning("%s: %d of %d preference rows have an empty answer or chosen equal to rejected (line %s): "
                    "they teach nothing (their DPO loss stays ln 2)", path, len(degenerate), len(rows), shown)
    return rows


_WHAT = {"messages": "a non-empty list of {\"role\": string, \"content\": string} messages",
         "prompt": "a non-empty string, a list of chat messages or a list of token ids",
         "chosen": "a string, a list of chat messages or a list of token ids",
         "completion": "a string or a list of token ids",
         "answer": "an integer (or a string holding one)"}
_WHAT["rejected"] = _WHAT["chosen"]


def _messages_problem(x: Any) -> str | None:
    if not isinstance(x, list) or not x:
        return "not a non-empty list"
    for j, m in enumerate(x):
        if not isinstance(m, dict):
            return f"message {j} is not an object"
        for k in ("role", "content"):
            if not isinstance(m.get(k), str):
                return f"message {j}: {k!r} is {type(m.get(k)).__name__}, not a string"
    return None


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and all(type(t) is int and 0 <= t < 2**31 for t in x)


def row_problem(row: dict, keys: tuple[str, ...]) -> str | None:
    """What is wrong with the types of ``row``'s ``keys`` (None when nothing is), as
    ``"key 'k': ..."``: ``messages`` a list of role/content string pairs holding an
    assistant turn; ``prompt`` a non-empty text, message list or token-id list;
    ``chosen``/``rejected`` the same (possibly empty), not messages beside token ids;
    ``completion`` text or ids; ``answer`` an integer or its decimal string."""
    for k in keys:
        v = row[k]
        if k == "messages":
            bad = _messages_problem(v)
            if bad is None and not any(m["role"] == "assistant" for m in v):
                bad = "no assistant turn to learn from"
        elif k in ("prompt", "chosen", "rejected"):
            if isinstance(v, str):
                bad = "empty" if k == "prompt" and not v.strip() else None
            elif isinstance(v, list) and v and isinstance(v[0], dict):
                bad = _messages_problem(v)
            elif _is_ids(v):
                bad = "an empty list" if k == "prompt" and not v else None
            else:
                bad = f"is {type(v).__name__}" + (f" {v!r:.40}" if isinstance(v, (int, float)) else "")
        elif k == "completion":
            bad = None if isinstance(v, str) or _is_ids(v) else f"is {type(v).__name__}"
        elif k == "answer":
            ok = (type(v) is int or (isinstance(v, str) and v.strip().lstrip("+-").isdigit()))
            bad = None if ok else f"is {type(v).__name__} {json.dumps(v)[:40]}"
        else:
            continue
        if bad:
            return f"key {k!r}: {bad} (expected {_WHAT[k]})"
    kinds = {k: ("messages" if isinstance(row[k], list) and row[k] and isinstance(row[k][0], dict) else
                 "ids" if isinstance(row[k], list) and row[k] else "other")
             for k in ("prompt", "chosen", "rejected") if k in keys}
    if "messages" in kinds.values() and "ids" in kinds.values():
        k = next(k for k, v in kinds.items() if v == "ids")
        return f"key {k!r}: token ids beside chat messages in the same row (give all as texts/messages or all as ids)"
    return None


def encode_answer(answer: Any, tok: Tokenizer | None, eos_ids: list[int]) -> list[int]:
    """An answer's ids: text encoded (no special tokens) and ended with the end-of-sequence
    token; ids as they are."""
    if isinstance(answer, str):
        if tok is None:
            raise ValueError("text answers need a tokenizer (the model has none): give token ids")
        return tok.encode(answer, add_special_tokens=False) + eos_ids[:1]
    return [int(t) for t in answer]


def _is_messages(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(m, dict) for m in x)


def _text_pair(row: dict, tok: Tokenizer, eos_ids: list[int], rc: RLHFConfig) -> tuple[list[int], list[list[int]]]:
    """A text preference row tokenised as TRL's ``DPOTrainer`` does: prompt + answer as one
    sequence (the chat template renders the whole conversation, so an answer ends with
    whatever the template puts after the assistant turn, e.g. ``<|im_end|>\n``; plain
    text ends with the end-of-sequence token), the answer being what follows the prefix
    that the prompt alone shares with both."""
    prompt, answers = row["prompt"], [row["chosen"], row["rejected"]]
    chat = _is_messages(prompt) or rc.chat
    if chat:
        msgs = prompt if _is_messages(prompt) else [{"role": "user", "content": prompt}]
        p = tok.encode_chat(msgs)
        turns = [a if _is_messages(a) else [{"role": "assistant", "content": a}] for a in answers]
        full = [tok.encode(tok.render_chat(msgs + t, add_generation_prompt=False), add_special_tokens=False)
                for t in turns]
    else:
        if any(_is_messages(a) for a in answers):
            raise ValueError("a preference row with a text prompt has chat-message answers: give both as messages")
        p = tok.encode(prompt)
        full = [tok.encode(prompt + a) for a in answers]
        full = [f if f[-1:] == eos_ids[:1] else f + eos_ids[:1] for f in full]
    n = len(os.path.commonprefix([p, *full]))
    return full[0][:n], [f[n:] for f in full]


def encode_pair(row: dict, tok: Tokenizer | None, eos_ids: list[int], rc: RLHFConfig) -> tuple[list[int], list[int],
                                                                                                 list[int]]:
    """``(prompt, chosen, rejected)`` ids of a preference row, the prompt cut to its last
    ``max_prompt_len`` tokens and the answers so that prompt + answer fits ``max_seq_len``.
    Texts (or chat messages) are tokenised as TRL does (see :func:`_text_pair`); token-id
    lists are taken as they are."""
    texts = all(isinstance(row[k], str) or _is_messages(row[k]) for k in ("prompt", "chosen", "rejected"))
    if texts:
        if tok is None:
            raise ValueError("text preference rows need a tokenizer (the model has none): give token ids")
        p, (c, r) = _text_pair(row, tok, eos_ids, rc)
        if not p:
            raise ValueError("a prompt is empty")
        p = p[-rc.max_prompt_len:]
    else:
        p = encode_prompt(row["prompt"], tok, rc)
        c, r = (encode_answer(row[k], tok, eos_ids) for k in ("chosen", "rejected"))
    room = max(1, rc.max_seq_len - len(p))
    return p, c[:room], r[:room]


def encode_sft(row: dict, tok: Tokenizer | None, eos_ids: list[int], rc: RLHFConfig) -> tuple[list[int], list[int]]:
    """``(ids, loss mask per token)`` of an SFT row: ``messages`` rendered with the chat
    template, the loss on the assistant turns only; or ``prompt`` + ``completion``."""
    if "messages" not in row:
        p = encode_prompt(row["prompt"], tok, rc)
        a = encode_answer(row["completion"], tok, eos_ids)
        ids = (p + a)[: rc.max_seq_len]
        return ids, ([0] * len(p) + [1] * len(a))[: rc.max_seq_len]
    if tok is None:
        raise ValueError("messages need a tokenizer (the model has none)")
    msgs = row["messages"]
    ids = tok.encode(tok.render_chat(msgs, add_generation_prompt=False), add_special_tokens=False)
    mask = [0] * len(ids)
    for i, m in enumerate(msgs):
        if m.get("role") != "assistant":
            continue
        before = len(tok.encode(tok.render_chat(msgs[:i], add_generation_prompt=True), add_special_tokens=False))
        after = len(tok.encode(tok.render_chat(msgs[: i + 1], add_generation_prompt=False), add_special_tokens=False))
        for j in range(before, min(after, len(ids))):
            mask[j] = 1
    if not any(mask):
        raise ValueError("an SFT conversation has no assistant turn to learn from")
    return ids[: rc.max_seq_len], mask[: rc.max_seq_len]


def pad_rows(rows: list[list[int]], pad_id: int) -> torch.Tensor:
    """Right-padded ``(N, T)`` ids."""
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def free_token(rows: list[list[int]]) -> int:
    """The smallest id that occurs in none of ``rows``: a pad that cannot be mistaken for a
    token (the reward model's ends are its first pads)."""
    used = {t for r in rows for t in r}
    return next(i for i in range(len(used) + 1) if i not in used)
