"""Speculative decoding with a draft model (vLLM's ``method="draft_model"``).

A smaller model that shares the target's tokenizer (checked: the same vocabulary size)
drafts ``k`` greedy tokens per decoding sequence; the target then verifies them in one
pass exactly as it verifies prompt-lookup drafts (:mod:`zeal.inference.speculative`),
so the output is the target's greedy output whatever the draft proposes.

The draft runs on its own :class:`ModelRunner` and paged KV cache. Each target sequence
has a shadow sequence there whose KV covers its known tokens and the drafts of the last
step; at the next step the shadow keeps the KV of the longest common prefix with the
target's tokens (the accepted drafts) and drops the rest, so a step costs the draft one
pass over the few tokens it has not seen (the target's corrected or bonus token) and
``k - 1`` one-token decode passes, all batched over the sequences. A shadow is freed when
its sequence stops running; one that finds no free draft block is dropped and its
sequence decodes without drafts that step.
"""

from __future__ import annotations

import copy
import dataclasses
import logging

from torch import nn

from zeal.config.inference import SpeculativeConfig
from zeal.inference.block_manager import BlockManager, blocks_for
from zeal.inference.model_runner import ModelRunner, as_serving_model
from zeal.inference.sequence import ScheduledChunk, SchedulerOutput, Sequence

log = logging.getLogger("zeal.inference")

DRAFT_BLOCK_SIZE = 16  # a shadow recomputes at most a few tokens, so small blocks waste little


class DraftModelProposer:
    """Greedy drafts from ``model`` for the target's decoding sequences. Owns the draft's
    KV cache (``num_blocks`` blocks of :data:`DRAFT_BLOCK_SIZE`) and one shadow
    :class:`Sequence` per target sequence it drafted for (by ``seq_id``)."""

    def __init__(self, model: nn.Module, num_blocks: int, vocab_size: int) -> None:
        model = as_serving_model(model)
        if model.config.vocab_size != vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocabulary ({model.config.vocab_size} tokens) "
                             f"differs from the target's ({vocab_size}); the draft must share the target's tokenizer")
        self.runner = ModelRunner(model, num_blocks, DRAFT_BLOCK_SIZE)
        self.bm = BlockManager(num_blocks, DRAFT_BLOCK_SIZE, enable_prefix_caching=False)
        self.shadows: dict[int, Sequence] = {}

    @classmethod
    def build(cls, cfg: SpeculativeConfig, model: nn.Module | None, target: ModelRunner, max_tokens: int,
              max_seqs: int, vocab_size: int) -> DraftModelProposer:
        """The proposer of ``cfg`` (``model``: a draft instance, else ``cfg.model`` is loaded
        in the target's dtype and device), its cache sized for ``max_tokens`` token slots
        (the target's) plus the drafts of ``max_seqs`` sequences."""
        if model is None:
            from zeal.inference.loader import load_model_and_tokenizer

            model, _, _ = load_model_and_tokenizer(cfg.model, target.dtype, target.device)
        extra = max_seqs * blocks_for(cfg.num_speculative_tokens + 1, DRAFT_BLOCK_SIZE)
        return cls(model.eval(), blocks_for(max_tokens, DRAFT_BLOCK_SIZE) + extra, vocab_size)

    def release(self, seq_id: int) -> None:
        """Free the shadow of a sequence (unknown ids are ignored)."""
        sh = self.shadows.pop(seq_id, None)
        if sh is not None:
            self.bm.free_seq(sh)

    def _sync(self, seq: Sequence, k: int) -> Sequence | None:
        """The shadow of ``seq`` holding its tokens, its KV kept for the common prefix and
        blocks for ``k - 1`` drafts more; None when the draft cache is out of blocks."""
        tokens = seq.tokens
        sh = self.shadows.get(seq.seq_id)
        if sh is not None and (len(sh.prompt_ids) > len(tokens) or tokens[len(sh.prompt_ids) - 1] != sh.prompt_ids[-1]):
            self.release(seq.seq_id)  # not a continuation of what the shadow saw
            sh = None
        if sh is None:
            sh = Sequence(seq.seq_id, seq.request_id, list(tokens), seq.params)
            self.shadows[seq.seq_id] = sh
        else:
            old = sh.tokens  # known tokens, then last step's drafts
            common = len(sh.prompt_ids)
            top = min(sh.num_computed, len(tokens))
            while common < top and old[common] == tokens[common]:
                common += 1
            sh.prompt_ids, sh.output_ids = list(tokens), []
            sh.num_computed = min(sh.num_computed, common, len(tokens) - 1)
            self.bm.trim(sh)
        if not self.bm.grow(sh, len(tokens) + k - 1):
            self.release(seq.seq_id)
            return None
        return sh

    def _pass(self, chunks: list[ScheduledChunk]) -> None:
        """One draft pass: each chunk's shadow gains the greedy token after its fed tokens."""
        toks = self.runner.argmax(self.runner.execute(SchedulerOutput(chunks=chunks)).cpu()).tolist()
        for c, t in zip(chunks, toks):
            c.seq.num_computed += c.num_tokens
            c.seq.output_ids.append(t)

    def propose(self, wants: list[tuple[Sequence, int]], running: list[Sequence]) -> None:
        """Set ``seq.draft_ids`` to ``k`` greedy draft tokens for each ``(seq, k)`` of
        ``wants`` (none where ``k`` is 0 or the draft cache is full); frees the shadows of
        sequences no longer ``running``."""
        live = {s.seq_id for s in running}
        for sid in [sid for sid in self.shadows if sid not in live]:
            self.release(sid)
        todo: list[tuple[Sequence, Sequence, int]] = []
        for seq, k in wants:
            seq.draft_ids = []
            sh = self._sync(seq, k) if k > 0 else None
            if sh is not None:
                todo.append((seq, sh, k))
        if not todo:
            return
        # pass 1: the tokens the draft has not seen; then k - 1 one-token decodes
        self._pass([ScheduledChunk(sh, sh.num_computed, sh.num_tokens - sh.num_computed, True) for _, sh, _ in todo])
        for j in range(1, max(k for _, _, k in todo)):
            self._pass([ScheduledChunk(sh, sh.num_computed, 1, True) for _, sh, k in todo if k > j])
        for seq, sh, k in todo:
            seq.draft_ids = list(sh.output_ids[:k])


def first_layers(model: nn.Module, num_layers: int) -> nn.Module:
    """A copy of the zeal ``model`` (Llama or GPT) keeping its first ``num_layers`` decoder
    layers, embeddings, final norm and head: a draft of the same tokenizer where no smaller
    sibling model is at hand (the layers skipped make it cheaper and less accurate)."""
    if not 1 <= num_layers < model.num_layers:
        raise ValueError(f"first_layers: num_layers must be in [1, {model.num_layers}), got {num_layers}")
    draft = copy.deepcopy(model)
    del draft.layer_stack()[num_layers:]
    cfg = draft.config
    field = next(f for f in ("num_hidden_layers", "n_layer") if hasattr(cfg, f))
    draft.config = dataclasses.replace(cfg, **{field: num_layers})
    return draft.eval()
