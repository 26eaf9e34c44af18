"""The choices of a chat completion as OpenAI shapes them: the assistant message (text or
parsed tool calls), per-token log-probs, usage, and the chunks of a streamed answer, each
choice streamed as its whole answer reads (see :func:`chat_chunks`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from zeal.inference.outputs import CompletionOutput, RequestOutput
from zeal.inference.tools import parse_tool_calls


def chat_logprobs(state: Any, c: CompletionOutput, last: int | None = None) -> dict | None:
    """OpenAI's ``choices[].logprobs``: per generated token (the ``last`` ones when given),
    its text, log-probability, bytes and ``top_logprobs`` alternatives, most likely first."""
    if c.logprobs is None:
        return None
    entries = c.logprobs if last is None else c.logprobs[len(c.logprobs) - last :] if last else []

    def item(t: int, lp: float) -> dict:
        return {"token": state.token_str(t), "logprob": lp, "bytes": state.token_bytes(t)}

    return {"content": [item(x["token"], x["logprob"]) | {
        "top_logprobs": [item(t, v) for t, v in sorted(x["top_logprobs"].items(), key=lambda kv: -kv[1])]}
        for x in entries]}


def usage_of(prompt_tokens: int, out: RequestOutput) -> dict:
    """OpenAI's ``usage`` of a chat completion: prompt, completion (every choice) and total tokens."""
    ct = sum(len(c.token_ids) for c in out.outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": ct, "total_tokens": prompt_tokens + ct}


def chat_message(c: CompletionOutput, funcs: list[dict] | None, parallel: bool = True) -> tuple[dict, str | None]:
    """The assistant message of a choice and its finish reason: parsed tool calls when the
    answer is a call to one of ``funcs`` (the first only unless ``parallel``), else the text."""
    calls = parse_tool_calls(c.text, funcs) if funcs else None
    if calls and not parallel:
        calls = calls[:1]
    if calls:
        return {"role": "assistant", "content": None, "refusal": None, "tool_calls": calls}, "tool_calls"
    return {"role": "assistant", "content": c.text, "refusal": None}, c.finish_reason


def may_be_call(text: str) -> bool:
    """Whether an answer so far could still turn out to be a tool call (bare or tagged)."""
    s = text.lstrip()
    return not s or s.startswith("{") or s.startswith("<tool_call>") or "<tool_call>".startswith(s)


def chat_chunks(state: Any, cid: str, name: str, prompt_tokens: int, include_usage: bool,
                 funcs: list[dict] | None = None, forced_call: bool = False, parallel: bool = True,
                 extra: dict | None = None):
    """The chunk maker of one streamed chat completion: the role first, then content deltas,
    each choice streamed as its whole answer reads. With ``funcs`` (tool calls possible) a
    choice's text is held back while it may still be a call (always, for a ``forced_call``)
    and sent at its end as one ``tool_calls`` delta, or as content with its log-probs when it
    is not a call (a forced call cut by ``length`` included); a choice that cannot be a call
    streams as plain content from then on. ``extra``: fields every chunk carries."""
    started: set[int] = set()
    plain: set[int] = set()  # choices known not to be calls: streamed as they come

    def chunks(_i: int, out: RequestOutput) -> Iterator[dict]:
        base = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": name}
        base |= extra or {}
        if include_usage:  # OpenAI: null on every chunk but the last
            base["usage"] = None
        for c in out.outputs:
            delta = {}
            if c.index not in started:
                started.add(c.index)
                delta["role"] = "assistant"
            if funcs is not None and c.index not in plain:  # held back so far
                whole, reason = None, c.finish_reason
                if not forced_call and not may_be_call(c.text):
                    plain.add(c.index)
                    whole = {"content": c.text} if c.text else {}
                elif c.finish_reason:
                    msg, reason = chat_message(c, funcs, parallel)
                    whole = ({"tool_calls": [{"index": k} | t for k, t in enumerate(msg["tool_calls"])]}
                             if msg.get("tool_calls") else {"content": msg["content"]} if msg["content"] else {})
                if whole is not None:
                    yield base | {"choices": [{"index": c.index, "delta": delta | whole,
                                               "logprobs": chat_logprobs(state, c), "finish_reason": reason}]}
                elif delta:
                    yield base | {"choices": [{"index": c.index, "delta": delta, "logprobs": None,
                                               "finish_reason": None}]}
                continue
            if c.delta_text:
                delta["content"] = c.delta_text
            if delta or c.finish_reason or (c.logprobs is not None and c.delta_token_ids):
                lp = chat_logprobs(state, c, len(c.delta_token_ids))
                yield base | {"choices": [{"index": c.index, "delta": delta, "logprobs": lp,
                                           "finish_reason": c.finish_reason}]}
        if include_usage and out.finished:
            yield base | {"choices": [], "usage": usage_of(prompt_tokens, out)}

    return chunks
