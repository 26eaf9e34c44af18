"""Plain data shared by the scheduler, the block manager and the model runner."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from zeal.inference.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One stream of tokens (a request with ``n > 1`` forks into ``n`` sequences).

    Invariant: the KV of ``tokens[:num_computed]`` is in the blocks of
    ``block_table``; ``tokens[num_computed:]`` is what the next passes must feed.
    A decoding sequence has exactly one uncomputed token (the last sampled one).
    Preemption by recompute resets ``num_computed`` to 0 and frees the blocks.
    """

    seq_id: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    index: int = 0  # choice index within the request (n > 1)
    group: str = ""  # the client request it belongs to (the scheduler shares passes fairly between groups)
    output_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[dict] = field(default_factory=list)
    # params.prompt_logprobs: the entry of prompt token j (j >= 1) at index j - 1, scored by the
    # logits of position j - 1 in the prefill passes (so its length is the next position to score)
    prompt_logprobs: list[dict] = field(default_factory=list)
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    pending_fork: bool = False  # n > 1: fork the siblings at the first sample
    draft_ids: list[int] = field(default_factory=list)
    lora_id: int = 0  # the LoRA adapter's load id (0: the base model); salts the prefix cache's hashes
    lora_slot: int = 0  # its device slot (zeal.inference.multi_lora; 0: none)
    matcher: object | None = None  # structured outputs: the grammar state (llguidance.LLMatcher)  # speculative tokens fed after the last sampled one
    # detokenizer state (owned by the engine)
    text: str = ""
    emitted_chars: int = 0
    emitted_tokens: int = 0
    last_token_time: float = 0.0

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def fed_tokens(self, start: int, n: int) -> list[int]:
        """The ``n`` tokens a pass feeds from position ``start``: known tokens, then drafts."""
        known = self.tokens[start : start + n]
        return known + self.draft_ids[: n - len(known)] if len(known) < n else known

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def needs_prompt_logits(self) -> bool:
        """Prompt log-probs were asked and some are not scored yet: the prefill passes must
        return a row of logits per prompt position (and no prefix-cache hit may skip one)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids) - 1

    def prompt_rows(self, start: int, n: int) -> tuple[int, int]:
        """``(first position, count)`` of the positions in ``[start, start + n)`` whose logits
        score a prompt token not scored yet (count 0: none)."""
        if not self.needs_prompt_logits:
            return start, 0
        lo = len(self.prompt_logprobs)
        if lo < start:  # a position was skipped: its token could never be scored
            raise RuntimeError(f"sequence {self.seq_id}: prompt position {lo} was not computed in a pass")
        return lo, max(0, min(start + n, len(self.prompt_ids) - 1) - lo)

    @property
    def is_decoding(self) -> bool:
        """Past its prompt: only the last sampled token is left to feed."""
        return self.num_uncomputed == 1 and len(self.output_ids) > 0

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass
class ScheduledChunk:
    """``num_tokens`` tokens of ``seq`` starting at ``seq.num_computed`` go into this pass;
    ``sample`` is true when the chunk ends the known tokens (a token is then drawn).
    ``num_draft``: the last of the chunk's tokens are speculative drafts (``seq.draft_ids``),
    and the pass returns a row of logits for every token of the chunk.
    ``num_prompt_rows``: the pass also returns the logits of the positions ``prompt_row_start``
    onwards, which score the prompt's next tokens (prompt log-probs); they come first."""

    seq: Sequence
    start: int
    num_tokens: int
    sample: bool
    num_draft: int = 0
    prompt_row_start: int = 0
    num_prompt_rows: int = 0

    @property
    def num_rows(self) -> int:
        """Rows of logits the pass returns for this chunk."""
        return self.num_prompt_rows + ((1 + self.num_draft) if self.sample else 0)


@dataclass
class SchedulerOutput:
    """One forward pass: ragged chunks (decodes first), block copies to do first
    (copy-on-write), and the sequences preempted or failed in this round."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def empty(self) -> bool:
        return not self.chunks
