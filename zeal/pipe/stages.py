"""One rank's pipeline stage: which part of the model it keeps, how it runs, what it ties.

:func:`split_model` turns a model into this rank's :class:`Stage`, in place:

* a :class:`~zeal.pipe.module.PipelineModule` already holds only its stage's layers;
* zeal's GPT and Llama are cut between transformer blocks (blocks split evenly over the
  stages); the embedding stays on the first stage, the final norm, the head and the
  loss on the last. Blocks of other stages become parameter-free placeholders and
  the embedding/head are removed where not needed, so every kept parameter keeps its
  global name (``transformer.h.7.attn.c_attn.weight``) and a checkpoint of a pipeline
  run loads into the whole model;
* a head tied to the embedding (GPT; Llama with ``tie_word_embeddings``) is a parameter
  of the first stage only (it is saved, clipped and updated there); the last stage
  computes with a copy, not a parameter, whose gradient goes to the first stage before
  the first stage's last backward of the step, and which receives the updated values
  after each step (DeepSpeed all-reduces the tied gradient between the two stages;
  the sum is the same).

With ``chunks`` V > 1 (the interleaved schedule) the blocks are cut into ``count·V``
equal chunks and stage ``index`` keeps chunks ``index, index + count, ...``: chunk ``c``
of this stage is virtual stage ``c·count + index``. The embedding stays with virtual
stage 0 (chunk 0 of the first stage), the norm, head and loss with the last virtual
stage (chunk V - 1 of the last stage).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zeal.models.checkpointing import causal_lm_loss, run_blocks
from zeal.pipe.module import PipelineModule, partition_uniform


@dataclass
class TiedHead:
    """The head weight tied to the embedding: the first stage's parameter, or where the
    last stage keeps its copy (``owner.<attr>``; installed by the engine)."""

    shape: tuple[int, ...]
    param: nn.Parameter | None = None  # first stage
    owner: nn.Module | None = None     # last stage
    attr: str = "weight"

    @property
    def copy(self) -> torch.Tensor:
        return getattr(self.owner, self.attr)


@dataclass
class StageTokens:
    """How a zeal decoder stage's blocks attend and number their tokens: dense attention
    over ``arange(T)`` by default; sequence parallelism sets Ulysses attention and this
    rank's global positions (``positions(t, device)`` for a chunk of ``t`` tokens)."""

    attention: Any = None
    positions: Callable[[int, torch.device], torch.Tensor] | None = None

    def at(self, t: int, device: torch.device) -> torch.Tensor:
        return self.positions(t, device) if self.positions is not None else torch.arange(t, device=device)

    def blocks_extra(self) -> tuple:
        return () if self.attention is None else (self.attention,)


@dataclass
class Stage:
    """``forwards[c](x)``: chunk ``c``'s pass (one chunk without interleaving) — the
    batch's inputs on virtual stage 0, the previous virtual stage's output elsewhere →
    its output; ``loss(output, labels)`` on the last stage (after its last chunk)."""

    module: nn.Module
    index: int
    count: int
    forwards: list[Callable[[Any], torch.Tensor]]
    loss: Callable[[torch.Tensor, Any], torch.Tensor] | None
    tied: TiedHead | None = None
    tokens: StageTokens | None = None  # zeal's GPT/Llama: how blocks number and attend tokens

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    @property
    def chunks(self) -> int:
        return len(self.forwards)

    def starts(self, chunk: int) -> bool:
        """Whether ``chunk`` of this stage is the model's first virtual stage (takes the inputs)."""
        return self.first and chunk == 0

    def ends(self, chunk: int) -> bool:
        """Whether ``chunk`` of this stage is the model's last virtual stage (gives the loss)."""
        return self.last and chunk == self.chunks - 1


def split_model(model: nn.Module, index: int, count: int, chunks: int = 1) -> Stage:
    """This rank's stage ``index`` of ``count``, in ``chunks`` model chunks (the model
    is changed in place)."""
    if isinstance(model, PipelineModule):
        if model.num_stages != count or model.stage_id != index or model.virtual_stages != chunks:
            raise ValueError(f"PipelineModule was built for stage {model.stage_id} of {model.num_stages} with "
                             f"virtual_stages {model.virtual_stages}; this rank is stage {index} of {count} "
                             f"(pipeline_parallel.size) with pipeline_parallel.virtual_stages {chunks}")
        loss = (lambda out, labels: model.loss_fn(out, labels)) if model.loss_fn is not None else None
        if index == count - 1 and loss is None:
            raise ValueError("PipelineModule needs a loss_fn for training")
        forwards = [lambda x, c=c: model(x, chunk=c) for c in range(chunks)]
        return Stage(model, index, count, forwards, loss)
    from zeal.models.gpt import GPT
    from zeal.models.llama import Llama

    if isinstance(model, GPT):
        return _split_decoder(model, index, count, chunks, _GPT_PARTS)
    if isinstance(model, Llama):
        return _split_decoder(model, index, count, chunks, _LLAMA_PARTS)
    raise ValueError(f"pipeline parallelism cannot split a {type(model).__name__}: give a zeal GPT or Llama, "
                     "or a zeal.pipe.PipelineModule")


@dataclass(frozen=True)
class _Parts:
    trunk: str
    blocks: str
    embeds: tuple[str, ...]  # trunk attributes of the first stage
    norm: str


_GPT_PARTS = _Parts("transformer", "h", ("wte", "wpe", "drop"), "ln_f")
_LLAMA_PARTS = _Parts("model", "layers", ("embed_tokens",), "norm")


def _split_decoder(model: nn.Module, index: int, count: int, chunks: int, parts: _Parts) -> Stage:
    trunk = getattr(model, parts.trunk)
    blocks: nn.ModuleList = getattr(trunk, parts.blocks)
    if chunks > 1 and len(blocks) % (count * chunks):
        raise ValueError(f"{len(blocks)} blocks do not divide into pipeline_parallel.size {count} x "
                         f"pipeline_parallel.virtual_stages {chunks} equal chunks")
    bounds = partition_uniform(len(blocks), count * chunks)
    ranges = [range(bounds[c * count + index], bounds[c * count + index + 1]) for c in range(chunks)]
    mine = {i for r in ranges for i in r}
    first, last = index == 0, index == count - 1
    embed = getattr(trunk, parts.embeds[0])
    tied_now = model.lm_head.weight is embed.weight
    for i in range(len(blocks)):
        if i not in mine:
            blocks[i] = nn.Identity()
    tied = None
    if not first:
        for name in parts.embeds:
            setattr(trunk, name, None)
    if not last:
        setattr(trunk, parts.norm, None)
        model.lm_head = None
    if tied_now and count > 1 and (first or last):
        tied = TiedHead(tuple(embed.weight.shape))
        if first:
            tied.param = embed.weight
        if last:
            del model.lm_head.weight  # computed with a copy the engine installs (not a parameter)
            tied.owner = model.lm_head
    is_llama = parts is _LLAMA_PARTS
    tokens = StageTokens()

    def chunk_forward(kept: list[nn.Module], embeds: bool) -> Callable[[torch.Tensor], torch.Tensor]:
        def forward(x: torch.Tensor) -> torch.Tensor:
            if embeds:
                ids = x
                positions = tokens.at(ids.shape[-1], ids.device)
                if is_llama:
                    x = trunk.embed_tokens(ids)
                else:
                    x = trunk.drop(trunk.wte(ids) + trunk.wpe(positions))
            if is_llama:
                rope = model.rope(tokens.at(x.shape[-2], x.device), x.dtype)
                return run_blocks(kept, x, model.checkpoint_policy, rope, *tokens.blocks_extra())
            # the policy activation checkpointing set
            return run_blocks(kept, x, model.checkpoint_policy, *tokens.blocks_extra())
        return forward

    def loss(x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return causal_lm_loss(model.lm_head, getattr(trunk, parts.norm)(x), labels, model.checkpoint_policy)

    forwards = [chunk_forward([blocks[i] for i in r], first and c == 0) for c, r in enumerate(ranges)]
    return Stage(model, index, count, forwards, loss if last else None, tied, tokens)


def split_batch(batch: Any) -> tuple[Any, Any]:
    """(inputs, labels) of one micro-batch: a pair, a dict with ``input_ids`` (and
    ``labels``, default the inputs), or one tensor (its own labels, as zeal's models shift)."""
    if isinstance(batch, dict):
        if "input_ids" not in batch:
            raise ValueError(f"a pipeline batch dict needs 'input_ids'; got keys {sorted(batch)}")
        return batch["input_ids"], batch.get("labels", batch["input_ids"])
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    if isinstance(batch, torch.Tensor):
        return batch, batch
    raise ValueError("a pipeline batch is (inputs, labels), a dict with input_ids, or a tensor of token ids; "
                     f"got {type(batch).__name__}")
