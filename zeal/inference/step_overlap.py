"""Async scheduling (vLLM V1's ``async_scheduling``): the host prepares step N+1 while the
device runs step N.

A synchronous step schedules, packs its inputs, launches the forward pass and the
sampler, then waits for the sampled ids before it appends them, checks stops and
detokenizes: the device idles from that wait until the next launch. Here the engine
launches step N+1 before it waits for step N's ids:

- every sequence sampled in step N carries a placeholder as its last token (how many
  tokens it gets is known: one), so the scheduler plans step N+1 as if it were there;
- the rows of step N+1 that feed a placeholder read step N's sampled ids where they lie,
  on the device (``ModelRunner.prev_tokens`` indexed by a row map packed with the step's
  inputs, ``StepPlan.fill_rows``): nothing waits for them before the launch;
- then the host waits for step N's ids (the device busy with N+1 meanwhile), puts them in
  place of the placeholders, checks stops, detokenizes and returns step N's outputs:
  outputs come one step behind, in the same order.

A sequence that finishes with step N's token (a stop token or string, an abort) was still
fed in step N+1: that row's token is discarded and its KV slot goes with its blocks.
Sequences certain to finish with the token in flight (``max_tokens`` or the length cap)
are held out of step N+1. The tokens are those of synchronous steps: greedy, and seeded
sampling (each sequence's generator draws the same numbers); unseeded rows draw from the
global generator, which a discarded row also advances.

Where the host is needed between the logits and the next step, steps run synchronously
(the step in flight is emitted first): while a request asks for logprobs or prompt
logprobs, penalties (the token histories), structured outputs (grammar masks), ``n > 1``
(forks at the first token), and with speculative decoding or tensor parallelism (the other
ranks receive plain token ids), as vLLM turns it off for the features that need it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from zeal.inference.device_sampler import sample_tokens
from zeal.inference.outputs import RequestOutput, StepStats
from zeal.inference.sampler import SampleResult
from zeal.inference.sampling_params import SamplingParams
from zeal.inference.sequence import Sequence

PLACEHOLDER = -1  # the last output id of a sequence whose sampled token is still on the device


def async_scheduling_on(cfg, device: torch.device, tensor_parallel: bool) -> bool:
    """Whether an engine overlaps its steps: ``cfg.async_scheduling``, or by default on CUDA;
    asked for together with speculative decoding or tensor parallelism: ``ValueError``."""
    want = cfg.async_scheduling
    if want is None:
        return device.type == "cuda" and torch.cuda.is_available() and not tensor_parallel \
            and cfg.speculative_config is None
    if want and (tensor_parallel or cfg.speculative_config is not None):
        what = "tensor parallelism" if tensor_parallel else "speculative decoding"
        raise ValueError(f"async_scheduling is not supported with {what} (its steps need the sampled ids on "
                         "the host); turn one of them off")
    return bool(want)


def needs_host(params: SamplingParams) -> bool:
    """A request whose next step needs its sampled tokens on the host (see the module docstring)."""
    return (params.logprobs is not None or params.prompt_logprobs is not None or params.needs_penalties
            or params.structured_outputs is not None or params.n > 1)


@dataclass
class InFlight:
    """A launched step: its sampled sequences (each holding a placeholder) and their ids."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # (R,) long, on the device: the step's sampled ids
    rows: list[int]  # seqs[i]'s row of tokens (no device indexing by a host list: that would sync)
    results: list[SampleResult | None] | None = None  # host results (sampled row by row after a failure)


class StepOverlap:
    """The engine's steps with the next step launched before the current one's ids are read.

    ``engine``: the :class:`~zeal.inference.engine.LLMEngine` (its scheduler, runner and
    per-request bookkeeping); :meth:`step` replaces its synchronous step and returns the
    outputs of the step before the one it launches. ``stats``: steps ``overlapped`` and
    ``sync`` (run synchronously for a request that needs the host)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.pending: InFlight | None = None
        self.stats = {"overlapped": 0, "sync": 0, "discarded": 0}

    def step(self) -> list[RequestOutput]:
        eng = self.engine
        if any(needs_host(r.params) for r in eng.requests.values()):
            if self.pending is not None:
                return self.flush()
            self.stats["sync"] += 1
            return eng._step()
        return self._overlapped()

    def flush(self) -> list[RequestOutput]:
        """Emit the step in flight (its tokens appended, stops checked); launches nothing."""
        touched: dict = {}
        self._resolve(touched, time.monotonic())
        return [self.engine._output(r) for r in touched.values()]

    def _certain_stop(self, seq: Sequence) -> bool:
        """The token in flight ends ``seq`` whatever it is: keep it out of the next step."""
        return len(seq.output_ids) >= seq.params.max_tokens or seq.num_tokens >= self.engine.max_seq_tokens

    def _overlapped(self) -> list[RequestOutput]:
        eng, runner = self.engine, self.engine.runner
        t0 = time.monotonic()
        prev = self.pending
        hold = {s.seq_id for s in prev.seqs if self._certain_stop(s)} if prev is not None else set()
        sched = eng.scheduler.schedule(hold)
        touched: dict = {}
        for seq in sched.failed:
            req = eng.requests.get(seq.request_id)
            if req is not None:
                req.error = seq.error
                touched[req.request_id] = req
        seqs: list[Sequence] = []
        tokens = results = None
        if sched.chunks:
            if prev is not None:  # step N+1's rows read step N's ids on the device
                runner.prev_tokens, runner.prev_rows = prev.tokens, {s.seq_id: r for s, r in zip(prev.seqs, prev.rows)}
            try:
                logits = eng._execute(sched, touched)
            finally:
                runner.prev_tokens, runner.prev_rows = None, {}
            seqs = [c.seq for c in sched.chunks if c.sample]  # one row each (no prompt rows, no drafts)
            tokens, results = self._sample(logits, seqs, touched)
            self.stats["overlapped"] += 1
        prompt_tokens = decode_tokens = 0
        for c in sched.chunks:
            if c.seq.is_decoding:
                decode_tokens += c.num_tokens
            else:
                prompt_tokens += c.num_tokens
            c.seq.num_computed += c.num_tokens
        now = time.monotonic()
        generated = self._resolve(touched, now)  # step N's ids: the step's one wait (the device runs N+1)
        for c in sched.chunks:  # step N+1's tokens are all known now: its full blocks can be hashed
            req = eng.requests.get(c.seq.request_id)
            if req is not None and req.error is None and not c.seq.finished:
                try:
                    eng.bm.commit(c.seq)
                except Exception as e:  # noqa: BLE001 - this request's failure, not the batch's
                    eng._fail(req, e, touched)
        outs = [eng._output(r) for r in touched.values()]  # before the placeholders: no output shows one
        live = []
        for i, seq in enumerate(seqs):
            req = eng.requests.get(seq.request_id)
            if seq.finished or req is None or req.error is not None or (results is not None and results[i] is None):
                self.stats["discarded"] += 1
                continue  # finished by the token before: this row's token is dropped
            seq.output_ids.append(PLACEHOLDER)
            live.append(i)
        if live:
            self.pending = InFlight([seqs[i] for i in live], tokens, live, results)
        stats = StepStats(sched.num_tokens, decode_tokens, prompt_tokens, len(sched.chunks), len(sched.preempted),
                          time.monotonic() - t0)
        eng.last_stats = stats
        eng.metrics.on_step(prompt_tokens, generated, stats.num_preempted)
        return outs

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], touched: dict):
        """The rows' tokens as a device tensor, nothing read back; when the batch raises, row
        by row on the host (failures isolated per request) and moved to the device."""
        eng = self.engine
        hist = [(s.prompt_ids, s.output_ids) for s in seqs]
        try:
            return sample_tokens(logits, hist, [s.params for s in seqs], [s.generator for s in seqs],
                                 eng.runner.argmax), None
        except Exception:  # noqa: BLE001 - isolated below
            pass
        results = eng._sample(logits, seqs, touched)
        toks = torch.tensor([r.token if r is not None else 0 for r in results], dtype=torch.long)
        return toks.to(eng.runner.device), results

    def _resolve(self, touched: dict, now: float) -> int:
        """Read the step in flight's ids, put them in place of the placeholders, check stops;
        a sequence finished or failed since it was launched drops its token. Returns tokens added."""
        prev, self.pending = self.pending, None
        if prev is None:
            return 0
        eng = self.engine
        every = prev.tokens.tolist() if prev.results is None else [r.token if r else 0 for r in prev.results]
        added = 0
        for seq, tok in zip(prev.seqs, [every[r] for r in prev.rows]):
            if seq.output_ids and seq.output_ids[-1] == PLACEHOLDER:
                seq.output_ids.pop()
            req = eng.requests.get(seq.request_id)
            if seq.finished or req is None or req.error is not None:
                self.stats["discarded"] += 1
                continue
            touched[req.request_id] = req
            try:
                eng._append(seq, SampleResult(int(tok)), now)
                added += 1
            except Exception as e:  # noqa: BLE001 - this request's failure, not the batch's
                eng._fail(req, e, touched)
        return added
