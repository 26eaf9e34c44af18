"""Speculative decoding by prompt lookup (n-gram drafts), verified in one forward pass
(drafts from a draft model: :mod:`zeal.inference.draft_model`, verified the same way).

Each step, a greedy decoding sequence looks for the latest earlier occurrence of its
last ``n`` tokens (``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``) and
drafts the up to ``num_speculative_tokens`` tokens that followed it. The pass then feeds
the last sampled token and the drafts together over the paged KV cache (their K/V written
first, then each fed token attends over the cache up to itself exactly as a decode step
would, through the same kernel) and returns a row of logits per fed token. Drafts are accepted while each equals the argmax
of the row before it; the argmax after the last accepted one is a token of its own, so a
step yields 1 to k + 1 tokens, exactly those plain greedy decoding would. The KV of the
rejected drafts is rolled back: the sequence's computed count stops before them (their
slots are overwritten later) and blocks holding only rejected positions are freed.
"""

from __future__ import annotations

from zeal.config.inference import SpeculativeConfig
from zeal.inference.sequence import Sequence


def propose_ngram(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix
    n-gram of ``tokens`` (``n_max >= n >= n_min``); empty when none occurs."""
    total = len(tokens)
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        pattern = tokens[total - n :]
        first = pattern[0]
        # latest start i < total - n with tokens[i : i + n] == pattern
        for i in range(total - n - 1, -1, -1):
            if tokens[i] == first and tokens[i : i + n] == pattern:
                return tokens[i + n : i + n + k]
    return []


def speculates(seq: Sequence) -> bool:
    """Whether ``seq`` may take drafts: greedy, no penalties, no logprobs, no grammar, a single choice."""
    p = seq.params
    return p.greedy and not p.needs_penalties and p.logprobs is None and p.n == 1 and p.structured_outputs is None


def num_drafts(seq: Sequence, cfg: SpeculativeConfig, max_seq_tokens: int) -> int:
    """How many tokens a decoding ``seq`` may draft this step: capped so that the step
    cannot run past ``max_tokens`` or the longest sequence (the verified tokens come on
    top of the drafts); 0 when it does not speculate."""
    room = min(seq.params.max_tokens - len(seq.output_ids), max_seq_tokens - seq.num_tokens) - 1
    k = min(cfg.num_speculative_tokens, room)
    return k if k > 0 and speculates(seq) else 0


def draft_for(seq: Sequence, cfg: SpeculativeConfig, max_seq_tokens: int) -> list[int]:
    """The n-gram drafts of a decoding ``seq`` this step (at most :func:`num_drafts`)."""
    k = num_drafts(seq, cfg, max_seq_tokens)
    return propose_ngram(seq.tokens, k, cfg.prompt_lookup_max, cfg.prompt_lookup_min) if k else []


def accept(drafts: list[int], targets: list[int]) -> list[int]:
    """The tokens of a verified step: ``targets[i]`` is the greedy token after the fed token
    ``i`` (the last sampled one, then the drafts); drafts are kept while they match, then
    the first mismatching (or the bonus) target ends the step."""
    out = []
    for d, t in zip(drafts, targets):
        out.append(t)
        if d != t:
            return out
    out.append(targets[len(drafts)])
    return out
