"""Serving metrics in the Prometheus text exposition format (no client library needed)."""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    """Cumulative-bucket histogram."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def render(self, name: str, help_: str) -> list[str]:
        lines = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        acc = 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            lines.append(f'{name}_bucket{{le="{b}"}} {acc}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines += [f"{name}_sum {self.sum}", f"{name}_count {self.count}"]
        return lines


class EngineMetrics:
    """Counters the engine updates each step; gauges are read at scrape time."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.requests_finished: dict[str, int] = {}
        self.preemptions_total = 0
        self.rejected_total = 0
        self.spec_drafts_total = 0  # verification steps that carried drafts
        self.spec_draft_tokens_total = 0
        self.spec_accepted_tokens_total = 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, generated tokens) over the last 10 s

    def on_step(self, prompt_tokens: int, gen_tokens: int, preempted: int) -> None:
        now = time.monotonic()
        with self.lock:
            self.prompt_tokens_total += prompt_tokens
            self.generation_tokens_total += gen_tokens
            self.preemptions_total += preempted
            self._recent.append((now, gen_tokens))
            while self._recent and self._recent[0][0] < now - 10.0:
                self._recent.popleft()

    def on_spec(self, drafted: int, accepted: int) -> None:
        """One speculative verification: ``drafted`` tokens proposed, ``accepted`` kept."""
        with self.lock:
            self.spec_drafts_total += 1
            self.spec_draft_tokens_total += drafted
            self.spec_accepted_tokens_total += accepted

    def spec_acceptance_rate(self) -> float:
        """Accepted over drafted tokens since start (0 before any draft)."""
        with self.lock:
            return self.spec_accepted_tokens_total / max(1, self.spec_draft_tokens_total)

    def on_first_token(self, ttft_s: float) -> None:
        with self.lock:
            self.ttft.observe(ttft_s)

    def on_token(self, latency_s: float) -> None:
        with self.lock:
            self.tpot.observe(latency_s)

    def on_finish(self, reason: str) -> None:
        with self.lock:
            self.requests_finished[reason] = self.requests_finished.get(reason, 0) + 1

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self.lock:
            toks = sum(n for t, n in self._recent if t >= now - 10.0)
        return toks / 10.0

    def render(self, gauges: dict[str, tuple[float, str]]) -> str:
        """Text format; ``gauges`` maps metric name to ``(value, help)``."""
        lines: list[str] = []
        for name, (value, help_) in gauges.items():
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name} {value}"]
        with self.lock:
            for name, value, help_ in (
                ("zeal_prompt_tokens_total", self.prompt_tokens_total, "Prompt tokens computed."),
                ("zeal_generation_tokens_total", self.generation_tokens_total, "Tokens generated."),
                ("zeal_preemptions_total", self.preemptions_total, "Sequences preempted by recompute."),
                ("zeal_requests_rejected_total", self.rejected_total, "Requests refused (queue full)."),
                ("zeal_spec_decode_num_drafts_total", self.spec_drafts_total, "Speculative steps that had drafts."),
                ("zeal_spec_decode_num_draft_tokens_total", self.spec_draft_tokens_total, "Draft tokens proposed."),
                ("zeal_spec_decode_num_accepted_tokens_total", self.spec_accepted_tokens_total,
                 "Draft tokens accepted (equal to the greedy token)."),
            ):
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} counter", f"{name} {value}"]
            lines += ["# HELP zeal_requests_finished_total Finished requests by reason.",
                      "# TYPE zeal_requests_finished_total counter"]
            for reason, n in sorted(self.requests_finished.items()):
                lines.append(f'zeal_requests_finished_total{{reason="{reason}"}} {n}')
            lines += self.ttft.render("zeal_time_to_first_token_seconds", "Time to first token.")
            lines += self.tpot.render("zeal_time_per_output_token_seconds", "Latency between output tokens.")
        return "\n".join(lines) + "\n"
