"""What the engine hands back after each step (plain data)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One choice of a request. ``delta_*`` hold what is new since the previous output
    (for streaming); ``text``/``token_ids`` the whole generation so far."""

    index: int
    token_ids: list[int]
    text: str = ""
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[dict] | None = None


@dataclass
class RequestOutput:
    """The state of a request after a step."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    error: str | None = None
    error_type: str = "invalid_request_error"  # of an error: the request's own fault, or "server_error"
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    # SamplingParams.prompt_logprobs: one entry per prompt token (None for the first), given in
    # the first output after the prefill and in the last one (None in the others)
    prompt_logprobs: list[dict | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""


@dataclass
class StepStats:
    """Counters of one engine step (for metrics and benchmarks)."""

    num_tokens: int = 0
    num_decode_tokens: int = 0
    num_prompt_tokens: int = 0
    num_seqs: int = 0
    num_preempted: int = 0
    duration_s: float = 0.0
