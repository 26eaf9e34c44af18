"""Turning logits into tokens: penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

Pure functions of ``(logits, token history, SamplingParams, generator)``; greedy
rows without penalties take a batched ``argmax`` fast path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from zeal.inference.sampling_params import SamplingParams


@dataclass
class SampleResult:
    """The drawn token and, when asked, its log-probability and the top alternatives."""

    token: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


def apply_penalties(logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int], p: SamplingParams) -> torch.Tensor:
    """Repetition penalty (HF: over prompt and output, divide positive logits and
    multiply negative ones), then presence/frequency penalties (OpenAI: over output)."""
    logits = logits.clone()
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=logits.device)
        if seen.numel():
            s = logits[seen]
            logits[seen] = torch.where(s > 0, s / p.repetition_penalty, s * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and output_ids:
        ids = torch.tensor(output_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(ids, minlength=logits.numel()).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature then top-k, top-p (nucleus) and min-p truncation; removed entries get -inf."""
    logits = logits / p.temperature
    if p.top_k and p.top_k > 0 and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        # drop a token when the mass *before* it already reaches top_p (the top token always stays)
        drop = (probs.cumsum(-1) - probs) >= p.top_p
        logits = logits.scatter(0, order[drop], float("-inf"))
    if p.min_p > 0.0:
        probs = torch.softmax(logits, -1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from ``probs (V,)`` by inverting its CDF at a single uniform number.

    Exact like ``torch.multinomial``, but ``multinomial`` draws one exponential
    variate per vocabulary entry on CPU (~0.75 ms for 49k entries); this draws one.
    """
    cdf = probs.double().cumsum(0)
    if not bool(torch.isfinite(cdf[-1])) or float(cdf[-1]) <= 0:  # NaN/inf logits: no distribution to invert
        return int(torch.nan_to_num(probs, nan=-1.0).argmax())
    u = torch.rand((), generator=generator, dtype=torch.float64, device=probs.device)
    # the first entry whose CDF exceeds u * total: never a zero-probability token
    i = int(torch.searchsorted(cdf, (u * cdf[-1]).reshape(1), right=True))
    if i == probs.numel():  # u * total rounded up to the total itself
        i = int(probs.nonzero()[-1])
    return i


def _logprob_info(logits: torch.Tensor, token: int, k: int) -> SampleResult:
    lp = torch.log_softmax(logits, -1)
    top = {}
    if k:
        vals, idx = torch.topk(lp, k)
        top = {int(i): float(v) for i, v in zip(idx, vals)}
    return SampleResult(token, float(lp[token]), top)


def score_tokens(logits: torch.Tensor, targets: list[int], k: int) -> list[dict]:
    """Log-probability entries of ``targets[i]`` under row ``i`` of ``logits (S, V)`` (the
    model's distribution, upcast to fp32): ``{"token", "logprob", "top_logprobs"}`` with the
    ``k`` most likely tokens, the shape :class:`SampleResult` gives generated tokens."""
    lp = torch.log_softmax(logits.float(), -1)
    idx = torch.tensor(targets, dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, idx[:, None])[:, 0].tolist()
    tops: list[dict[int, float]] = [{} for _ in targets]
    if k:
        vals, ids = torch.topk(lp, k, dim=-1)
        tops = [dict(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    return [{"token": t, "logprob": c, "top_logprobs": top} for t, c, top in zip(targets, chosen, tops)]


def sample(
    logits: torch.Tensor,
    histories: list[tuple[list[int], list[int]]],
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[SampleResult]:
    """Draw one token per row of ``logits (S, V)`` (any float dtype; rows that need more
    than an argmax are taken in fp32). ``histories[i]`` is ``(prompt_ids, output_ids)``.
    Logprobs are those of the model's distribution (before penalties and truncation).
    ``argmax``: the row-wise argmax for greedy rows (default ``Tensor.argmax(-1)``)."""
    results: list[SampleResult | None] = [None] * len(params)
    fast = [i for i, p in enumerate(params) if p.greedy and not p.needs_penalties]
    if fast:
        rows = logits if len(fast) == len(params) else logits[fast]
        toks = (argmax(rows) if argmax is not None else rows.argmax(-1)).tolist()
        for i, t in zip(fast, toks):
            results[i] = SampleResult(t)
    for i, p in enumerate(params):
        if results[i] is None:
            row = logits[i].float()
            if p.needs_penalties:
                row = apply_penalties(row, *histories[i], p)
            if p.greedy:
                tok = int(row.argmax())
            else:
                probs = torch.softmax(filter_logits(row, p), -1)
                tok = draw(probs, generators[i])
            results[i] = SampleResult(tok)
        if params[i].logprobs is not None:
            results[i] = _logprob_info(logits[i].float(), results[i].token, params[i].logprobs)
    return results
