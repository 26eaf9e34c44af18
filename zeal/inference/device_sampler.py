"""Sampling as one batched tensor program on the logits' device.

:func:`sample_batch` turns logits ``(S, V)`` into one token per row with every option of
:class:`SamplingParams` (penalties, temperature, top-k, top-p, min-p, per-request seeds,
log-probs and top log-probs, an allowed-token mask from structured outputs) as batched
tensor ops on the device the logits live on; the only data that comes back to the host
is one packed ``float64`` tensor holding the drawn token ids and the requested
log-probs (one device-to-host transfer per step). :func:`verify_targets` does the same
for speculative verification (one argmax over every verified row, one transfer).

It computes what :func:`zeal.inference.sampler.sample` computes row by row: the same
fp32 arithmetic per row, the same CDF inversion in float64 with one uniform number per
sampled row drawn from the row's generator (seeded requests keep their exact stream; the
unseeded rows draw from the global generator in row order, as before). On CPU, greedy
rows keep the fused argmax kernel (``argmax``) as their fast path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zeal.inference.sampler import SampleResult
from zeal.inference.sampling_params import SamplingParams

_COLUMNS = ("temperature", "kth", "top_k_on", "top_p", "top_p_on", "min_p", "rep", "freq", "pres")


def param_table(params: list[SamplingParams], vocab: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Every row's sampling parameters as columns ``(S, 1)`` of one fp32 tensor, moved to
    ``device`` in one copy (fp32 holds each exactly as the scalar ops of the row-by-row
    sampler round it; top-k's index is below 2**24)."""
    rows = []
    for p in params:
        k = p.top_k if p.top_k and 0 < p.top_k < vocab else 0
        rows.append([p.temperature, max(k, 1) - 1, float(k > 0), p.top_p, float(p.top_p < 1.0), p.min_p,
                     p.repetition_penalty, p.frequency_penalty, p.presence_penalty])
    t = torch.tensor(rows, dtype=torch.float32).to(device, non_blocking=True)
    return {name: t[:, i : i + 1] for i, name in enumerate(_COLUMNS)}


def apply_penalties_batch(logits: torch.Tensor, histories: list[tuple[list[int], list[int]]],
                          params: list[SamplingParams], table: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Repetition (prompt and output, HF) then presence/frequency (output, OpenAI) penalties
    of every row at once; ``logits (S, V)`` fp32, returned as a new tensor."""
    s, v = logits.shape
    dev = logits.device
    table = table if table is not None else param_table(params, v, dev)
    out = logits.clone()
    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep_rows:
        flat = [i * v + t for i in rep_rows for t in sorted(set(histories[i][0]) | set(histories[i][1]))]
        seen_mask = torch.zeros(s, v, dtype=torch.bool, device=dev)
        if flat:
            seen_mask.view(-1)[torch.tensor(flat, dtype=torch.long).to(dev)] = True
        rp = table["rep"]
        out = torch.where(seen_mask, torch.where(out > 0, out / rp, out * rp), out)
    freq_rows = [i for i, p in enumerate(params)
                 if (p.presence_penalty or p.frequency_penalty) and histories[i][1]]
    if freq_rows:
        flat = torch.tensor([i * v + t for i in freq_rows for t in histories[i][1]], dtype=torch.long).to(dev)
        counts = torch.zeros(s * v, dtype=out.dtype, device=dev)
        counts.index_add_(0, flat, torch.ones(flat.numel(), dtype=out.dtype, device=dev))
        counts = counts.view(s, v)
        # rows without these penalties (or history) subtract an exact 0
        out = out - (table["freq"] * counts + table["pres"] * (counts > 0).to(out.dtype))
    return out


def filter_batch(logits: torch.Tensor, params: list[SamplingParams],
                 table: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p truncation of every row; removed entries
    get -inf (what :func:`zeal.inference.sampler.filter_logits` does to one row)."""
    v = logits.shape[1]
    table = table if table is not None else param_table(params, v, logits.device)
    logits = logits / table["temperature"]
    if any(p.top_k and 0 < p.top_k < v for p in params):
        sorted_logits = torch.sort(logits, dim=-1, descending=True).values
        kth = sorted_logits.gather(1, table["kth"].long())
        logits = logits.masked_fill((table["top_k_on"] > 0) & (logits < kth), float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        drop = (table["top_p_on"] > 0) & ((probs.cumsum(-1) - probs) >= table["top_p"])
        logits = logits.masked_fill(torch.zeros_like(drop).scatter_(1, order, drop), float("-inf"))
    if any(p.min_p > 0.0 for p in params):
        probs = torch.softmax(logits, -1)
        logits = logits.masked_fill(probs < table["min_p"] * probs.amax(-1, keepdim=True), float("-inf"))
    return logits


def draw_batch(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of ``probs (S, V)`` by inverting the row's CDF (float64) at one
    uniform number from the row's generator (None: the global one, in row order)."""
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]
    dev = probs.device
    u = torch.empty(probs.shape[0], dtype=torch.float64, device=dev)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:  # one call: a float64 uniform per element, in order, as scalar draws would be
        u[unseeded] = torch.rand(len(unseeded), dtype=torch.float64, device=dev)
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand((), generator=g, dtype=torch.float64, device=dev)
    idx = torch.searchsorted(cdf, u[:, None] * total, right=True)[:, 0]
    v = probs.shape[1]
    last_nonzero = v - 1 - (probs > 0).flip(-1).to(torch.int8).argmax(-1)
    idx = torch.where(idx >= v, last_nonzero, idx)
    bad = ~torch.isfinite(total[:, 0]) | (total[:, 0] <= 0)  # NaN/inf logits: no distribution to invert
    return torch.where(bad, torch.nan_to_num(probs, nan=-1.0).argmax(-1), idx)


def apply_masks(logits: torch.Tensor, masks: list[torch.Tensor | None] | None) -> torch.Tensor:
    """The rows' allowed-token masks (structured outputs) applied as one tensor op."""
    if masks is None or all(m is None for m in masks):
        return logits
    allowed = torch.stack([m if m is not None else torch.ones(logits.shape[1], dtype=torch.bool) for m in masks])
    return logits.masked_fill(~allowed.to(logits.device, non_blocking=True), float("-inf"))


def sample_tokens(logits: torch.Tensor, histories: list[tuple[list[int], list[int]]], params: list[SamplingParams],
                  generators: list[torch.Generator | None],
                  argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The token of every row as a device tensor ``(S,) long`` (no transfer)."""
    fast = [p.greedy and not p.needs_penalties for p in params]
    if all(fast):
        return (argmax(logits) if argmax is not None else logits.argmax(-1)).long()
    work = logits.float()
    table = param_table(params, logits.shape[1], logits.device)  # the step's one parameter transfer
    if any(p.needs_penalties for p in params):
        work = apply_penalties_batch(work, histories, params, table)
    toks = work.argmax(-1)
    rand = [i for i, p in enumerate(params) if not p.greedy]
    if rand:
        sub = [params[i] for i in rand]
        sub_table = {k: c[rand] for k, c in table.items()}
        probs = torch.softmax(filter_batch(work[rand], sub, sub_table), -1)
        toks[rand] = draw_batch(probs, [generators[i] for i in rand])
    fast_rows = [i for i, f in enumerate(fast) if f]
    if fast_rows and argmax is not None:  # keep the fused kernel's ties/rounding for plain greedy rows
        toks[fast_rows] = argmax(logits[fast_rows]).long()
    return toks


def sample_batch(logits: torch.Tensor, histories: list[tuple[list[int], list[int]]], params: list[SamplingParams],
                 generators: list[torch.Generator | None],
                 argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 masks: list[torch.Tensor | None] | None = None) -> list[SampleResult]:
    """One :class:`SampleResult` per row of ``logits (S, V)`` (any float dtype, any device),
    as :func:`zeal.inference.sampler.sample`. ``masks``: structured-output allowed-token
    masks per row (None: unconstrained), applied on the device before sampling; log-probs
    are those of the (masked) model distribution, before penalties and truncation."""
    if not params:
        return []
    logits = apply_masks(logits, masks)
    toks = sample_tokens(logits, histories, params, generators, argmax)
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not want:
        return [SampleResult(int(t)) for t in toks.tolist()]  # the one transfer
    k = max(params[i].logprobs or 0 for i in want)
    lp = torch.log_softmax(logits[want].float(), -1)
    chosen = lp.gather(1, toks[want][:, None])[:, 0]
    parts = [toks.double(), chosen.double()]
    if k:
        vals, ids = torch.topk(lp, k, dim=-1)
        parts += [vals.double().reshape(-1), ids.double().reshape(-1)]
    flat = torch.cat(parts).tolist()  # token ids < 2**53: exact in float64; the one transfer
    s, w = len(params), len(want)
    out = [SampleResult(int(t)) for t in flat[:s]]
    vals_l, ids_l = flat[s + w : s + w + w * k], flat[s + w + w * k :]
    for j, i in enumerate(want):
        kk = params[i].logprobs or 0
        top = {int(ids_l[j * k + c]): vals_l[j * k + c] for c in range(kk)}
        out[i] = SampleResult(out[i].token, flat[s + j], top)
    return out


def verify_targets(logits: torch.Tensor, spans: list[tuple[int, int]],
                   argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[list[int]]:
    """Speculative verification: the greedy token after every fed token, for the row spans
    ``[(first row, rows)]`` of ``logits``, from one argmax and one transfer."""
    if not spans:
        return []
    idx = [r for first, n in spans for r in range(first, first + n)]
    rows = logits[idx] if idx != list(range(logits.shape[0])) else logits
    flat = (argmax(rows) if argmax is not None else rows.argmax(-1)).tolist()
    out, at = [], 0
    for _, n in spans:
        out.append(flat[at : at + n])
        at += n
    return out
