"""Sequence parallelism inside each pipeline stage (PP × SP).

The mesh puts sp inside dp and pp outside both, so a rank's pipeline neighbours hold the
same sp rank: the activations passed between stages are this rank's chunk of the
sequences ``(B, T/S, h)``, never the whole of them. :func:`shard_stage` makes a zeal
GPT/Llama :class:`~zeal.pipe.stages.Stage` sequence-parallel in place:

* every pass runs its blocks with Ulysses attention over ``sp`` and numbers its tokens
  with this rank's global positions (``r·n + arange(n)`` for a chunk of ``n``);
* the first stage's first pass takes the full sequences the engine draws and keeps this
  rank's chunk (padded to a multiple of S, as :func:`~zeal.parallel.sequence_shard.shard_batch`);
* the last stage's loss shifts the full labels, keeps this rank's chunk of them and
  returns the whole sequences' mean (sums and token counts all-reduced over sp; tiled
  over rows when ``tiling.tiled_logits_loss`` set the model's ``loss_shards``).

The pipeline engine's gradient mean over dp (= data × sp) then gives the single-process
update, as without pipelining.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zeal.dist.comm import Comm
from zeal.models.hf_tiled import head_params
from zeal.models.tiled import tiled_logits_loss
from zeal.parallel.sequence_shard import IGNORE, sequence_loss, shard_batch
from zeal.parallel.ulysses import UlyssesAttention
from zeal.pipe.stages import Stage


def shard_stage(stage: Stage, model: nn.Module, comm: Comm) -> None:
    """Make ``stage`` (of zeal's GPT or Llama ``model``) run on this rank's chunk of every
    sequence; ValueError for a stage zeal did not cut (a user's PipelineModule)."""
    if stage.tokens is None:
        raise ValueError("sequence_parallel_size > 1 with pipeline parallelism needs zeal's GPT or Llama cut "
                         "into stages (a PipelineModule's layers do not take Ulysses attention)")
    rank = comm.ranks.index(comm.ctx.rank)
    limit = getattr(model, "max_positions", None) if not hasattr(model, "rope") else None
    stage.tokens.attention = UlyssesAttention(comm)
    stage.tokens.positions = _positions(rank, limit)
    if stage.first:
        first = stage.forwards[0]
        stage.forwards[0] = lambda ids: first(shard_batch(ids if ids.dim() == 2 else ids[None], None, None, comm)[0])
    if stage.last:
        stage.loss = _loss(model, comm)


def _positions(rank: int, limit: int | None) -> Callable[[int, torch.device], torch.Tensor]:
    def positions(n: int, device: torch.device) -> torch.Tensor:
        pos = rank * n + torch.arange(n, device=device)
        return pos if limit is None else pos.clamp(max=limit - 1)  # GPT's padding tokens: in-table positions
    return positions


def _loss(model: nn.Module, comm: Comm) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    trunk = getattr(model, "model", None) if hasattr(model, "rope") else getattr(model, "transformer", None)
    norm = trunk.norm if hasattr(model, "rope") else trunk.ln_f

    def loss(x: torch.Tensor, labels: Any) -> torch.Tensor:
        labels = labels if labels.dim() == 2 else labels[None]
        _, _, y, _ = shard_batch(labels, labels, None, comm)
        head, policy = model.lm_head, model.checkpoint_policy
        project, ce = policy.logits_loss or (head, F.cross_entropy)
        h = norm(x)
        if policy.loss_shards is not None:
            total, count = tiled_logits_loss(project, h, y, policy.loss_shards, params=head_params(head),
                                             cross_entropy=ce, ignore_index=IGNORE,
                                             vocab=getattr(head, "out_features", None), hold=policy.hold_params)
        else:
            logits = project(h)
            total = ce(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1), ignore_index=IGNORE,
                       reduction="sum")
            count = (y != IGNORE).sum()
        return sequence_loss(total, count, comm)
    return loss
