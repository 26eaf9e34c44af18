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
of the largest group (below) is preempted by recompute: its blocks are freed
and it goes back to the waiting queue, in arrival order, with its generated
tokens appended to its prompt (prefix caching usually makes the recompute
cheap). Requests that could never fit are refused at admission by the engine,
so the loop never hangs.

Fair share between client requests. Every sequence belongs to a *group*: the
client request it came from (all prompts and ``n`` choices of one HTTP request
share one). Each pass serves the groups round-robin, in the order they arrived,
and within a group oldest first:

- decodes: the groups' decoding sequences are interleaved (one of each group,
  then a second of each, ...); while some group has prompt work, one slot (and
  one token) per such group is kept back for it (at most half the pass);
- prompt chunks: continuations, then admissions, interleaved the same way; every
  prompt (or rest of one) that fits in the budget left runs whole, then one prompt
  is split over what remains (Dynamic SplitFuse: at most one split per pass), the
  split going to the group that waited longest for one;
- memory: a group blocked at admission for lack of KV blocks may preempt the
  youngest sequences of a group running at least two more sequences than it.

The bound. With ``G`` groups holding work, ``M = max_num_seqs`` and
``B = max_num_batched_tokens``, each pass gives every group at least
``min(its decoding sequences, floor((M - G) / G))`` decode slots, and a group's
prompt either runs whole (when it fits in the ``B - M`` or more tokens the
decodes leave, after the other groups' whole prompts) or gets the pass's split
at least once every ``G`` passes. So a request of ``s <= floor((M - G) / G)``
sequences with a ``P``-token prompt and ``T`` tokens to generate finishes within
about ``G * ceil(P / (B - M)) + T`` passes of its arrival, against
``ceil(P / B) + T - 1`` alone: beside one request of any size (``G = 2``), at
most about twice its solo passes (while the KV cache can hold it: a larger group
is preempted to make room). A pass is bounded in work by ``B`` tokens, so the
bound holds in time too, up to the cost of a full pass.
"""

from __future__ import annotations

from collections import Counter, deque
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
        self._passes = 0
        self._last_split: dict[str, int] = {}  # group -> the pass that last split one of its prompts

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

    def schedule(self, hold: set[int] | frozenset[int] = frozenset()) -> SchedulerOutput:
        """The next pass. ``hold``: ids of decoding sequences to leave out of it (async scheduling:
        those certain to finish with the token in flight)."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        max_seqs = self.config.max_num_seqs
        scheduled: set[int] = set()
        prompt_groups = {s.group for s in self.running if not s.is_decoding and s.num_uncomputed > 0}
        prompt_groups |= {s.group for s in self.waiting}
        keep = min(len(prompt_groups), max_seqs // 2, budget // 2)  # kept back for the prompt work

        # 1. decode tokens first, groups interleaved, oldest first within a group
        for seq in interleave([s for s in self.running if s.is_decoding and s.seq_id not in hold]):
            if budget <= keep or len(out.chunks) >= max_seqs - keep:
                break
            if seq.status is not SeqStatus.RUNNING or not seq.is_decoding:
                continue
            while not self.bm.can_append(seq):
                victim = self._victim(scheduled)
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

        # 2. prompt chunks, groups interleaved: every prompt (rest) that fits whole, then one split
        cands = interleave([s for s in self.running if s.seq_id not in scheduled and not s.is_decoding
                            and s.num_uncomputed > 0] + list(self.waiting))
        blocked: set[str] = set()  # groups whose next arrival found no KV blocks
        deferred: list[Sequence] = []
        for seq in cands:
            if budget == 0 or len(out.chunks) == max_seqs:
                break
            if seq.group in blocked:
                continue
            if seq.num_uncomputed > budget:
                deferred.append(seq)
            elif self._admit(seq, scheduled, blocked, out):
                budget -= self._schedule_prompt(seq, budget, out)
                scheduled.add(seq.seq_id)
        # the split goes to the group that waited longest for one (ties: the interleaved order)
        deferred.sort(key=lambda s: self._last_split.get(s.group, -1))
        for seq in deferred:
            if budget == 0 or len(out.chunks) == max_seqs:
                break
            if seq.group not in blocked and self._admit(seq, scheduled, blocked, out):
                budget -= self._schedule_prompt(seq, budget, out)
                scheduled.add(seq.seq_id)
                self._last_split[seq.group] = self._passes
                break
        self._passes += 1
        if len(self._last_split) > 64:  # forget finished requests (else one entry per request served, forever)
            live = {s.group for s in self.running} | {s.group for s in self.waiting}
            self._last_split = {g: p for g, p in self._last_split.items() if g in live}
        return out

    def _admit(self, seq: Sequence, scheduled: set[int], blocked: set[str], out: SchedulerOutput) -> bool:
        """Whether ``seq`` may run a prompt chunk now: running already, or admitted with KV
        blocks for its whole known token list (preempting a larger group if need be). A
        request that can never fit fails; one that must wait blocks its group for this pass."""
        if seq.status is SeqStatus.RUNNING:
            return True
        if seq.status is not SeqStatus.WAITING:
            return False
        if not self.bm.can_allocate(seq) and not self._make_room(seq, scheduled, out):
            if not self.running and not out.chunks:
                # every block is free and it still does not fit: it never will
                self.waiting.remove(seq)
                seq.status = SeqStatus.FINISHED
                seq.finish_reason = "error"
                seq.error = f"request needs more KV blocks than the cache has ({self.bm.num_blocks})"
                out.failed.append(seq)
            else:
                blocked.add(seq.group)  # arrival order within a group: the rest of it waits too
            return False
        self.waiting.remove(seq)
        self.bm.allocate(seq)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        return True

    def _victim(self, scheduled: set[int]) -> Sequence:
        """The sequence to preempt for blocks: the youngest not yet in this pass of the group
        running the most sequences (the youngest overall among equals)."""
        counts = Counter(s.group for s in self.running)
        cands = [s for s in reversed(self.running) if s.seq_id not in scheduled]
        return max(cands, key=lambda s: counts[s.group])

    def _make_room(self, seq: Sequence, scheduled: set[int], out: SchedulerOutput) -> bool:
        """Preempt sequences of groups running at least two more sequences than ``seq``'s
        (youngest of the largest first) until ``seq`` fits; False when it still does not."""
        counts = Counter(s.group for s in self.running)
        mine = counts[seq.group]
        while not self.bm.can_allocate(seq):
            cands = [s for s in reversed(self.running) if s.seq_id not in scheduled and counts[s.group] > mine + 1]
            if not cands:
                return False
            victim = max(cands, key=lambda s: counts[s.group])
            self._preempt(victim, out)
            counts[victim.group] -= 1
        return True

    def _schedule_prompt(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        n = min(seq.num_uncomputed, budget)
        lo, rows = seq.prompt_rows(seq.num_computed, n)
        out.chunks.append(ScheduledChunk(seq, seq.num_computed, n, n == seq.num_uncomputed, prompt_row_start=lo,
                                         num_prompt_rows=rows))
        return n


def interleave(seqs: list[Sequence]) -> list[Sequence]:
    """``seqs`` round-robin by group: the first of each group (groups in order of first
    appearance), then the second of each, ...; the order within a group is kept."""
    by_group: dict[str, list[Sequence]] = {}
    for s in seqs:
        by_group.setdefault(s.group, []).append(s)
    lists = list(by_group.values())
    out: list[Sequence] = []
    for i in range(max((len(x) for x in lists), default=0)):
        out.extend(x[i] for x in lists if i < len(x))
    return out
