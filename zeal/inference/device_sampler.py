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

CPU_ROWS = 4  # rows sampled together on CPU (see sample_tokens)
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
    of every row at once; ``logits (S, V)`` fp32, returned as a new tensor. Only the
    entries of tokens in a row's history are touched (one index transfer per kind)."""
    s, v = logits.shape
    dev = logits.device
    table = table if table is not None else param_table(params, v, dev)
    out = logits.clone()
    flat_out = out.view(-1)
    seen = [(i, t) for i, p in enumerate(params) if p.repetition_penalty != 1.0
            for t in sorted(set(histories[i][0]) | set(histories[i][1]))]
    if seen:
        idx = torch.tensor([[i * v + t for i, t in seen], [i for i, _ in seen]], dtype=torch.long).to(dev)
        rp = table["rep"].reshape(-1)[idx[1]]
        x = flat_out[idx[0]]
        flat_out[idx[0]] = torch.where(x > 0, x / rp, x * rp)
    counted = []  # (row, token, count) over each penalised row's output
    for i, p in enumerate(params):
        if (p.presence_penalty or p.frequency_penalty) and histories[i][1]:
            counts: dict[int, int] = {}
            for t in histories[i][1]:
                counts[t] = counts.get(t, 0) + 1
            counted += [(i, t, c) for t, c in counts.items()]
    if counted:
        idx = torch.tensor([[i * v + t for i, t, _ in counted], [i for i, _, _ in counted],
                            [c for _, _, c in counted]], dtype=torch.long).to(dev)
        c = idx[2].to(out.dtype)
        pen = table["freq"].reshape(-1)[idx[1]] * c + table["pres"].reshape(-1)[idx[1]] * (c > 0).to(out.dtype)
        flat_out[idx[0]] = flat_out[idx[0]] - pen
    return out


def row_cumsum(x: torch.Tensor) -> torch.Tensor:
    """``x.cumsum(-1)`` of a 2-D tensor; on CPU one row at a time (torch's 1-D cumsum there is
    ~3x faster than its cumsum along the last dim of a matrix, with the same sums)."""
    if x.device.type != "cpu":
        return x.cumsum(-1)
    out = torch.empty_like(x)
    for i in range(x.shape[0]):
        torch.cumsum(x[i], 0, out=out[i])
    return out


def filter_batch(logits: torch.Tensor, params: list[SamplingParams],
                 table: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p truncation of every row; removed entries
    get -inf (what :func:`zeal.inference.sampler.filter_logits` does to one row)."""
    v = logits.shape[1]
    table = table if table is not None else param_table(params, v, logits.device)
    logits = logits / table["temperature"]
    kmax = max((p.top_k for p in params if p.top_k and 0 < p.top_k < v), default=0)
    if kmax:  # the k-th largest of each row from one topk of the largest k asked
        kth = torch.topk(logits, kmax, dim=-1).values.gather(1, table["kth"].long())
        logits = logits.masked_fill((table["top_k_on"] > 0) & (logits < kth), float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        drop = (table["top_p_on"] > 0) & ((row_cumsum(probs) - probs) >= table["top_p"])
        logits = logits.masked_fill(torch.zeros_like(drop).scatter_(1, order, drop), float("-inf"))
    if any(p.min_p > 0.0 for p in params):
        probs = torch.softmax(logits, -1)
        logits = logits.masked_fill(probs < table["min_p"] * probs.amax(-1, keepdim=True), float("-inf"))
    return logits


def draw_batch(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of ``probs (S, V)`` by inverting the row's CDF (float64) at one
    uniform number from the row's generator (None: the global one, in row order)."""
    cdf = row_cumsum(probs.double())
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
    bad = ~torch.isfinite(total[:, 0]) | (total[:, 0] <= 0)  # NaN/inf logits: no distribution to invert
    if dev.type == "cpu" and not bool(bad.any()) and not bool((idx >= v).any()):
        return idx  # on CPU a check costs no device sync: skip the fallbacks' passes over the rows
    last_nonzero = v - 1 - (probs > 0).flip(-1).to(torch.int8).argmax(-1)
    idx = torch.where(idx >= v, last_nonzero, idx)
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
    am = argmax if argmax is not None else (lambda x: x.argmax(-1))
    if all(fast):
        return am(logits).long()
    toks = torch.empty(len(params), dtype=torch.long, device=logits.device)
    fast_rows = [i for i, f in enumerate(fast) if f]
    if fast_rows:  # plain greedy rows: the fused kernel on CPU
        toks[fast_rows] = am(logits[fast_rows]).long()
    slow = [i for i, f in enumerate(fast) if not f]
    sub = [params[i] for i in slow]
    work = (logits if len(slow) == len(params) else logits[slow]).float()
    table = param_table(sub, logits.shape[1], logits.device)  # the step's one parameter transfer
    if any(p.needs_penalties for p in sub):
        work = apply_penalties_batch(work, [histories[i] for i in slow], sub, table)
    rand = [j for j, p in enumerate(sub) if not p.greedy]
    out = work.argmax(-1) if len(rand) < len(sub) else torch.empty(len(sub), dtype=torch.long, device=logits.device)
    # on CPU a few rows at a time: each row's passes then stay in cache (the vocabulary-wide
    # intermediates of a whole batch do not), with the same per-row arithmetic
    step = len(rand) if logits.device.type != "cpu" else CPU_ROWS
    for c0 in range(0, len(rand), step):
        part = rand[c0 : c0 + step]
        whole = len(part) == len(sub)
        rtable = table if whole else {k: col[part] for k, col in table.items()}
        probs = torch.softmax(filter_batch(work if whole else work[part], [sub[j] for j in part], rtable), -1)
        drawn = draw_batch(probs, [generators[slow[j]] for j in part])
        if whole:
            out = drawn
        else:
            out[part] = drawn
    toks[slow] = out
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
    step = len(want) if logits.device.type != "cpu" else CPU_ROWS  # in cache on CPU, as sample_tokens
    chosen, vals, ids = [], [], []
    for c0 in range(0, len(want), step):
        part = want[c0 : c0 + step]
        lp = torch.log_softmax(logits[part].float(), -1)
        chosen.append(lp.gather(1, toks[part][:, None])[:, 0])
        if k:
            v, i = torch.topk(lp, k, dim=-1)
            vals.append(v.reshape(-1))
            ids.append(i.reshape(-1))
    parts = [toks.double(), torch.cat(chosen).double()]
    if k:
        parts += [torch.cat(vals).double(), torch.cat(ids).double()]
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
