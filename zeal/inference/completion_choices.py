"""The choices of a legacy ``/v1/completions`` answer, whole or streamed: text, ``echo`` of the
prompt, and OpenAI's legacy ``logprobs`` object (``tokens``, ``token_logprobs``,
``top_logprobs``, ``text_offset``) over the echoed prompt and the generated tokens.

Prompt scoring (what lm-evaluation-harness's ``local-completions`` sends: token-id prompts,
``echo: true, logprobs: 1, max_tokens: 0 or 1``) reads the prompt tokens' log-probs, which
the engine computes in the prefill pass (``SamplingParams.prompt_logprobs``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from zeal.inference.outputs import CompletionOutput, RequestOutput
from zeal.inference.protocol import APIError, CompletionRequest
from zeal.inference.tokenizer import Tokenizer


def legacy_logprobs(token_str: Callable[[int], str], token_ids: list[int], entries: list[dict | None],
                     offset: int) -> tuple[dict, int]:
    """OpenAI's legacy ``logprobs`` object over ``token_ids`` (``entries[i]`` None: a token with no
    log-prob, the prompt's first) and the text offset after it. ``text_offset`` counts characters
    of the choice's text, token by token from ``offset`` (as vLLM: the token strings' lengths)."""
    ts = token_str
    tokens = [ts(t) for t in token_ids]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [None if e is None else e["logprob"] for e in entries],
            "top_logprobs": [None if e is None else {ts(t): v for t, v in e["top_logprobs"].items()}
                             for e in entries],
            "text_offset": offsets}, offset


class CompletionChoices:
    """The choices of one ``/v1/completions`` request, whole or as stream deltas. With ``echo``
    the prompt comes first (its text, and with ``logprobs`` its tokens' log-probs from the
    prefill, the first one null); ``echo_only`` (``max_tokens: 0``): the prompt alone, the token
    drawn at the end of the prefill dropped (as vLLM)."""

    def __init__(self, tokenizer: Tokenizer | None, token_str: Callable[[int], str], req: CompletionRequest,
                 prompts_in: list, prompts: list[list[int]], echo_only: bool) -> None:
        self.tokenizer, self.token_str = tokenizer, token_str
        self.req, self.prompts_in, self.prompts = req, prompts_in, prompts
        self.echo_only = echo_only
        self.offsets: dict[int, int] = {}  # streaming: choice index -> the text offset reached
        self.num_completion_tokens = 0

    def _echo_text(self, i: int) -> str:
        p, tok = self.prompts_in[i], self.tokenizer
        if isinstance(p, str):
            return p
        return tok.decode(self.prompts[i], skip_special_tokens=False) if tok is not None else ""

    def _prompt_part(self, i: int, out: RequestOutput) -> tuple[str, dict | None, int]:
        """The echoed prompt: text, log-probs object (None unless asked), the offset after it."""
        if self.req.logprobs is None:
            return self._echo_text(i), None, 0
        if out.prompt_logprobs is None:
            raise APIError(503, "the engine returned no prompt log-probs", "server_error")
        lp, offset = legacy_logprobs(self.token_str, self.prompts[i], out.prompt_logprobs, 0)
        return self._echo_text(i), lp, offset

    def _generated_part(self, c: CompletionOutput, text: str, ids: list[int],
                        offset: int) -> tuple[str, dict | None, int]:
        """The last ``ids`` generated in ``c`` with their ``text``: text, log-probs, end offset."""
        if self.echo_only:
            return "", None, offset
        self.num_completion_tokens += len(ids)
        if self.req.logprobs is None:
            return text, None, offset
        lp, offset = legacy_logprobs(self.token_str, ids, c.logprobs[len(c.logprobs) - len(ids) :] if ids else [],
                                      offset)
        return text, lp, offset

    def _finish_reason(self, c: CompletionOutput) -> str | None:
        return ("length" if c.finish_reason else None) if self.echo_only else c.finish_reason

    def whole(self, i: int, out: RequestOutput) -> list[dict]:
        """The choices of prompt ``i``'s finished output."""
        choices = []
        for c in out.outputs:
            text, lp, off = self._prompt_part(i, out) if self.req.echo else ("", None, 0)
            gtext, glp, _ = self._generated_part(c, c.text, c.token_ids, off)
            if glp is not None:
                lp = glp if lp is None else {k: lp[k] + glp[k] for k in lp}
            choices.append({"index": i * self.req.n + c.index, "text": text + gtext, "logprobs": lp,
                            "finish_reason": self._finish_reason(c)})
        return choices

    def deltas(self, i: int, out: RequestOutput) -> Iterator[dict]:
        """The streamed choices of one output of prompt ``i`` (the echoed prompt first)."""
        for c in out.outputs:
            index = i * self.req.n + c.index
            if index not in self.offsets:
                self.offsets[index] = 0
                if self.req.echo:
                    text, lp, self.offsets[index] = self._prompt_part(i, out)
                    yield {"index": index, "text": text, "logprobs": lp, "finish_reason": None}
            text, lp, self.offsets[index] = self._generated_part(c, c.delta_text, c.delta_token_ids,
                                                                 self.offsets[index])
            reason = self._finish_reason(c)
            if text or reason or (lp is not None and c.delta_token_ids):
                yield {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}
