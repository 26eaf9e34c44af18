"""RLHF data: JSONL rows into token ids. ``messages`` (SFT), ``prompt``/``chosen``/``rejected``
(RM, DPO), ``prompt`` (PPO, GRPO); texts go through the tokenizer (prompts through the
chat template), and token-id lists are taken as they are (models without a tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from zeal.inference.tokenizer import Tokenizer
from zeal.rlhf.common import encode_prompt
from zeal.rlhf.config import RLHFConfig


def read_jsonl(path: str | Path, keys: tuple[str, ...]) -> list[dict]:
    """The rows of a JSONL file; each must hold ``keys`` (one clear error naming the line)."""
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not JSON ({e.msg})") from None
        missing = [k for k in keys if not isinstance(row, dict) or k not in row]
        if missing:
            raise ValueError(f"{path}:{i}: missing key(s) {', '.join(missing)} (this job reads {', '.join(keys)})")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def encode_answer(answer: Any, tok: Tokenizer | None, eos_ids: list[int]) -> list[int]:
    """An answer's ids: text encoded (no special tokens) and ended with the end-of-sequence
    token; ids as they are."""
    if isinstance(answer, str):
        if tok is None:
            raise ValueError("text answers need a tokenizer (the model has none): give token ids")
        return tok.encode(answer, add_special_tokens=False) + eos_ids[:1]
    return [int(t) for t in answer]


def encode_pair(row: dict, tok: Tokenizer | None, eos_ids: list[int], rc: RLHFConfig) -> tuple[list[int], list[int],
                                                                                                 list[int]]:
    """``(prompt, chosen, rejected)`` ids of a preference row, answers cut so that prompt +
    answer fits ``max_seq_len``."""
    p = encode_prompt(row["prompt"], tok, rc)
    room = max(1, rc.max_seq_len - len(p))
    return p, encode_answer(row["chosen"], tok, eos_ids)[:room], encode_answer(row["rejected"], tok, eos_ids)[:room]


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
