"""Continuous batching with Dynamic SplitFuse.

Each call to :meth:`Scheduler.schedule` builds one forward pass filled up to a
token budget: first one token for every decoding sequence, then prompt chunks
(first the continuation of a prompt split in an earlier pass, then new
requests in arrival order). A prompt longer than what is left of the budget is
split; the rest is continued in the next pass, and only the pass that finishes
a prompt samples. A new request is admitted only when KV blocks exist for its
whole known token list (FastGen's rule: prompts are split for lack of budget,
never for lack of memory).

When a decoding sequence finds no free block, the youngest running sequence
is preempted by recompute: its blocks are freed and it goes back to the front
of the waiting queue with its generated tokens appended to its prompt (prefix
caching usually makes the recompute cheap). The oldest sequence always makes
progress, and requests that could never fit are refused at admission by the
engine, so the loop never hangs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from zeal.inference.block_manager import BlockManager
from zeal.inference.sequence import ScheduledChunk, SchedulerOutput, SeqStatus, Sequence


@dataclass
class SchedulerConfig:
    """Per-pass budgets. ``max_num_batched_tokens`` is SplitFuse's token budget."""

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError(
                f"max_num_batched_tokens {self.max_num_batched_tokens} and max_num_seqs "
                f"{self.max_num_seqs} must be >= 1"
            )


class Scheduler:
    """Decides which tokens of which sequences go into the next pass.

    Invariant per pass: ``sum(chunk.num_tokens) <= max_num_batched_tokens`` and
    ``len(chunks) <= max_num_seqs``; every running sequence holds blocks for all
    tokens it is about to feed.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.bm = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked sibling joins the running set right after its parent."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished and release its blocks (idempotent)."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.bm.free_seq(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        seq.draft_ids = []
        self.bm.free_seq(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        # keep the waiting queue in arrival order
        i = 0
        while i < len(self.waiting) and self.waiting[i].arrival_time <= seq.arrival_time:
            i += 1
        self.waiting.insert(i, seq)
        out.preempted.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        max_seqs = self.config.max_num_seqs
        scheduled: set[int] = set()

        # 1. decode tokens first, oldest first; preempt the youngest when blocks run out
        for seq in list(self.running):
            if budget == 0 or len(out.chunks) == max_seqs:
                break
            if seq.status is not SeqStatus.RUNNING or not seq.is_decoding:
                continue
            while not self.bm.can_append(seq):
                victim = next(s for s in reversed(self.running) if s.seq_id not in scheduled)
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            copy = self.bm.append_slot(seq)
            if copy is not None:
                out.copies.append(copy)
            # drafts take no block that a sequence still to be scheduled may need for its own token
            reserve = len(self.running) - len(out.chunks) - 1
            k = self.bm.append_draft_slots(seq, min(len(seq.draft_ids), budget - 1), reserve) if seq.draft_ids else 0
            del seq.draft_ids[k:]
            out.chunks.append(ScheduledChunk(seq, seq.num_computed, 1 + k, True, num_draft=k))
            scheduled.add(seq.seq_id)
            budget -= 1 + k

        # 2. prompt chunks: continuations of split prompts, then new arrivals (FCFS)
        for seq in self.running:
            if budget == 0 or len(out.chunks) == max_seqs:
                break
            if seq.seq_id in scheduled or seq.is_decoding or seq.num_uncomputed == 0:
                continue
            budget -= self._schedule_prompt(seq, budget, out)
            scheduled.add(seq.seq_id)
        while self.waiting and budget > 0 and len(out.chunks) < max_seqs:
            seq = self.waiting[0]
            if not self.bm.can_allocate(seq):
                if not self.running and not out.chunks:
                    # every block is free and it still does not fit: it never will
                    self.waiting.popleft()
                    seq.status = SeqStatus.FINISHED
                    seq.finish_reason = "error"
                    seq.error = f"request needs more KV blocks than the cache has ({self.bm.num_blocks})"
                    out.failed.append(seq)
                    continue
                break
            self.waiting.popleft()
            self.bm.allocate(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            budget -= self._schedule_prompt(seq, budget, out)
            scheduled.add(seq.seq_id)
        return out

    def _schedule_prompt(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        n = min(seq.num_uncomputed, budget)
        lo, rows = seq.prompt_rows(seq.num_computed, n)
        out.chunks.append(ScheduledChunk(seq, seq.num_computed, n, n == seq.num_uncomputed, prompt_row_start=lo,
                                         num_prompt_rows=rows))
        return n
