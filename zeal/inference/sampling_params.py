"""What a request asks of generation: :class:`SamplingParams`."""

from __future__ import annotations

from dataclasses import dataclass, field

from zeal.inference.structured import StructuredOutputsParams

# Temperatures below this sample greedily: dividing logits by a much smaller one overflows
# fp32 to inf, and inf - inf turns every probability into NaN (as vLLM's _SAMPLING_EPS).
MIN_TEMPERATURE = 1e-5
# torch.Generator.manual_seed takes [-2**63, 2**64 - 1]; choice i of n seeds with seed + i
SEED_RANGE = (-(2**63), 2**64 - 1)


@dataclass
class SamplingParams:
    """Per-request generation settings (OpenAI names where they exist).

    ``temperature == 0`` is greedy, and so is any temperature below ``MIN_TEMPERATURE``.
    Penalties follow OpenAI (presence/frequency, over generated tokens) and Hugging Face
    (repetition, over prompt and output). ``seed`` makes sampling reproducible per
    request (choice ``i`` of ``n`` uses ``seed + i``). ``logprobs=k`` returns the chosen
    token's log-probability and the ``k`` most likely alternatives at each step;
    ``prompt_logprobs=k`` does the same for every prompt token after the first (scored by
    the prefill pass itself: what ``echo`` with ``logprobs`` returns).
    ``structured_outputs`` (a :class:`StructuredOutputsParams` or its fields as a dict)
    constrains every draw to a JSON schema, any JSON object, a regex or a grammar.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field and the rule."""
        checks = [
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= -1, f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.seed is None or SEED_RANGE[0] <= self.seed <= SEED_RANGE[1] - (self.n - 1),
             f"seed + n - 1 must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}] (choice i uses seed + i), got "
             f"seed={self.seed}, n={self.n}"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs must be in [0, 20], got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
