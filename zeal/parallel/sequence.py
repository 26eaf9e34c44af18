"""The sequence-parallel apply-step: Ulysses attention swapped in, batches sharded, loss exact.

``apply_sequence_parallel(model, mesh)`` (called by :mod:`zeal.train.build` when
``sequence_parallel_size > 1``) routes the model's attention through
:mod:`zeal.parallel.ulysses` and returns a :class:`SequenceParallel`, the callable the
engine runs in place of ``model(...)``. It accepts two kinds of batch on every rank of an
sp group:

* **full sequences** (the simple path; what ``zeal train`` and ``training_data=`` give):
  every sp rank passes the same ``input_ids (B, T)`` and ``labels``. The labels are
  shifted first (the next-token label of a chunk's last token lives in the next chunk),
  the length is padded to a multiple of S (pad labels -100, pad positions repeat the last
  one; causal attention keeps real tokens blind to the pad at the end), and each rank
  keeps its chunk ``[r·T/S, (r+1)·T/S)`` with its global positions;
* **its own chunk**, as DeepSpeed's ``UlyssesSPDataLoaderAdapter`` yields it:
  ``input_ids``, global ``position_ids`` and already shifted ``shift_labels``, each
  ``(B, T/S)``.

The loss is the full sequences' mean next-token cross-entropy on every sp rank: each rank
sums its chunk's token losses (ignore-index -100), the sums and the valid-token count are
all-reduced over ``sp`` ("control" traffic). Its backward hands each rank's chunk
``S / count`` per token: the S sp ranks each differentiate the same loss, and the gradient
average over the data-parallel group (dp = data × sp) divides by S again, so the update
is the single-process one (DeepSpeed sums over sp and averages over data instead).
Without labels the logits come back whole ``(B, T, V)`` (all-gathered over sp).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zeal.dist.comm import Comm
from zeal.dist.mesh import Mesh
from zeal.models.hf_tiled import head_params, hf_lm_parts
from zeal.models.moe_mlp import moe_aux_loss
from zeal.models.tiled import NumShards, tiled_logits_loss
from zeal.parallel.sequence_pipe import shard_stage
from zeal.parallel.sequence_shard import IGNORE, sequence_loss, shard_batch
from zeal.parallel.ulysses import UlyssesAttention, register_hf_attention

__all__ = ["IGNORE", "SequenceParallel", "apply_sequence_parallel", "gather_sequence", "is_hf_model",
           "sequence_loss", "shard_batch"]


def is_hf_model(model: nn.Module) -> bool:
    """A transformers model: its config selects the attention implementation."""
    return hasattr(getattr(model, "config", None), "_attn_implementation")


def apply_sequence_parallel(model: nn.Module, mesh: Mesh, stage: Any = None) -> SequenceParallel | None:
    """Swap ``model``'s attention for Ulysses attention over ``mesh.sp`` (None at sp 1,
    and for a pipeline ``stage``, whose passes are made sequence-parallel in place:
    :func:`zeal.parallel.sequence_pipe.shard_stage`); raises ValueError naming what does
    not fit (heads, model kind)."""
    if mesh.sp_size == 1:
        return None
    cfg = getattr(model, "config", None)
    if is_hf_model(model) and (getattr(cfg, "num_local_experts", 0) or getattr(cfg, "num_experts", 0)):
        raise ValueError("sequence_parallel_size > 1 with a Hugging Face mixture-of-experts model is not "
                         "supported (its forward takes the router loss per chunk): load it as zeal's Llama "
                         "(zeal.models.hf_moe) or use sequence_parallel_size 1")
    if stage is not None:
        shard_stage(stage, model, mesh.sp)
        return None
    if is_hf_model(model):
        register_hf_attention(model, mesh.sp)
        return SequenceParallel(model, mesh.sp, hf=True)
    heads = _zeal_heads(model)
    if heads is None:
        raise ValueError(f"sequence parallelism needs zeal's GPT or Llama or a Hugging Face model; got "
                         f"{type(model).__name__}")
    return SequenceParallel(model, mesh.sp, hf=False)


def _zeal_heads(model: nn.Module) -> tuple[int, int] | None:
    cfg = getattr(model, "config", None)
    if hasattr(cfg, "n_head"):
        return cfg.n_head, cfg.n_head
    if hasattr(cfg, "num_attention_heads") and hasattr(model, "layer_stack"):
        return cfg.num_attention_heads, cfg.num_key_value_heads
    return None


class SequenceParallel:
    """``sp(*args, **kwargs)`` runs the model on this rank's chunk of the batch and returns
    what ``model(*args, **kwargs)`` returns without sp: the full sequences' loss (zeal
    models), an output whose ``.loss`` is (Hugging Face: its ``.logits`` stay this
    rank's chunk), or the whole logits when no labels are given. See the module docstring."""

    def __init__(self, model: nn.Module, comm: Comm, hf: bool) -> None:
        self.model, self.comm, self.hf = model, comm, hf
        self.attention = UlyssesAttention(comm)
        self._signature = inspect.signature(model.forward)
        self.loss_shards: NumShards | None = None  # tiling.tiled_logits_loss: the chunk's loss over tiles
        self.hold_params = None  # ZeRO-3's holding context for the head (zeal.train.tiling.attach_to_zero)
        # DeepSpeed's ALST semantics for a chunk batch (set by zeal.deepspeed's ulysses_sp.adopt):
        # the chunk's own mean loss, its gradient scaled by this (sp size: DeepSpeed sums over sp)
        self.deepspeed_chunk_loss: float | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        own = {k: kwargs.pop(k) for k in ("shift_labels", "position_ids", "positions", "attention_mask")
               if k in kwargs}
        a = dict(self._signature.bind_partial(*args, **kwargs).arguments)
        extra = a.pop("kwargs", None)
        if isinstance(extra, dict):
            a.update(extra)
        a.update(own)
        if a.get("input_ids") is None:
            raise ValueError("sequence parallelism needs input_ids (the sequences it shards)")
        ids = a.pop("input_ids")
        if ids.dim() == 1:
            ids = ids[None]
        labels = a.pop("labels", None)
        shift = a.pop("shift_labels", None)
        pos = a.pop("position_ids", None)
        pos = a.pop("positions", None) if pos is None else pos
        mask = a.pop("attention_mask", None)
        if mask is not None and not bool((mask != 0).all()):
            raise ValueError("sequence parallelism takes right-padded batches without an attention_mask: "
                             "mark the padding -100 in labels")
        if shift is not None:  # this rank's own chunk (DeepSpeed's UlyssesSPDataLoaderAdapter)
            if pos is None:
                raise ValueError("a sequence-parallel chunk (shift_labels given) needs its global position_ids")
            chunk, pos_chunk, y, full_len = ids, pos.expand_as(ids), shift, None
        else:
            chunk, pos_chunk, y, full_len = shard_batch(ids, labels, pos, self.comm)
        if y is not None and self.loss_shards is not None:
            return self._tiled(chunk, pos_chunk, y, a, own=shift is not None)
        out = self._run(chunk, pos_chunk, a)
        logits = out if isinstance(out, torch.Tensor) else out.logits
        if y is None:
            full = gather_sequence(logits, self.comm)[:, :full_len]
            if isinstance(out, torch.Tensor):
                return full
            out.logits = full
            return out
        if shift is not None and self.deepspeed_chunk_loss is not None:
            loss = self._deepspeed_chunk(*_chunk_sum(logits, y))
        else:
            loss = self._with_aux(self._loss(logits, y))
        if isinstance(out, torch.Tensor):
            return loss
        out.loss = loss
        return out

    # -- pieces --------------------------------------------------------------------------------
    def _run(self, ids: torch.Tensor, pos: torch.Tensor, rest: dict) -> Any:
        if self.hf:
            rest.setdefault("use_cache", False)
            return self.model(input_ids=ids, position_ids=pos, **rest)
        return self.model(ids, positions=pos, attention=self.attention, **rest)

    def _tiled(self, ids: torch.Tensor, pos: torch.Tensor, y: torch.Tensor, rest: dict, own: bool = False) -> Any:
        """The loss of this rank's chunk over tiles of rows: the head's input from the model
        (zeal: ``hidden_only``; Hugging Face: its base model), never whole logits."""
        if self.hf:
            parts = hf_lm_parts(self.model)
            if isinstance(parts, str):
                raise ValueError(f"tiling.tiled_logits_loss under sequence parallelism: {parts}")
            base, head = parts
            rest.setdefault("use_cache", False)
            out = base(input_ids=ids, position_ids=pos, **rest)
            project, ce, h = head, F.cross_entropy, out.last_hidden_state
        else:
            head = self.model.lm_head
            project, ce = self.model.checkpoint_policy.logits_loss or (head, F.cross_entropy)
            h = self.model(ids, positions=pos, attention=self.attention, hidden_only=True, **rest)
        total, count = tiled_logits_loss(project, h, y, self.loss_shards, params=head_params(head),
                                         cross_entropy=ce, ignore_index=IGNORE,
                                         vocab=getattr(head, "out_features", None), hold=self.hold_params)
        if self.deepspeed_chunk_loss is not None and own:
            loss = self._deepspeed_chunk(total, count)
        else:
            loss = self._with_aux(sequence_loss(total, count, self.comm))
        if not self.hf:
            return loss
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast(loss=loss, logits=None)

    def _with_aux(self, loss: torch.Tensor) -> torch.Tensor:
        """zeal's MoE models: ``loss + aux_loss_coef ·`` the load-balancing loss, whose
        value the gates made the whole sequences' (:func:`zeal.moe.gating.sequence_aux`)."""
        coef = getattr(getattr(self.model, "config", None), "aux_loss_coef", None)
        aux = moe_aux_loss(self.model) if coef and not self.hf else None
        return loss if aux is None else loss + coef * aux

    def _loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        local, count = _chunk_sum(logits, y)
        return sequence_loss(local, count, self.comm)

    def _deepspeed_chunk(self, total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """DeepSpeed's chunk loss: this chunk's mean over its counted tokens (NaN when it has
        none, as Hugging Face's), whose gradient is scaled by ``deepspeed_chunk_loss``."""
        mean = total / count.to(total.dtype)
        scale = self.deepspeed_chunk_loss
        return mean if scale == 1.0 else mean * scale - (mean * (scale - 1.0)).detach()


def _chunk_sum(logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed next-token cross-entropy of a chunk (ignore-index -100) and its token count."""
    local = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1),
                            ignore_index=IGNORE, reduction="sum")
    return local, (y != IGNORE).sum()


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        x = x.contiguous()
        out = torch.empty((comm.size, *x.shape), dtype=x.dtype, device=x.device)
        comm.all_gather(out, x, "sequence")
        return torch.cat(list(out), dim=1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        comm = ctx.comm
        n = g.shape[1] // comm.size
        r = comm.ranks.index(comm.ctx.rank)
        return g[:, r * n:(r + 1) * n] * comm.size, None  # every sp rank differentiates the same output


def gather_sequence(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """``(B, T/S, ...)`` chunks -> ``(B, T, ...)`` on every sp rank (differentiable; the
    backward scales by S as the loss's does)."""
    return _GatherSequence.apply(x, comm) if comm.active else x
