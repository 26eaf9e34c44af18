"""Vocabulary parallelism: the embedding and the LM head split by vocabulary rows over the
``tp`` dimension, and the cross-entropy computed from each rank's slice of the logits.

Where the tp size ``T`` divides the vocabulary ``V`` (and there is no pipeline), tp rank
``r`` holds rows ``[r·V/T, (r+1)·V/T)`` of the input embedding and of the head (a tied
embedding/head stays one Parameter: the same slice). The splits are recorded in
``TensorParallel.splits`` (dim 0), so the gradient norm, the sharded-state API,
checkpoints (a TP 2 save loads at TP 1) and ``engine.module_state_dict()`` see whole
tensors. Where ``T`` does not divide ``V``, for a ``PipelineModule``'s layers, or for a head
that is not a plain ``nn.Linear``, the embedding and head stay whole (as
:mod:`zeal.parallel.tensor` describes).

Traffic (Comm kind ``"vocab"``, dimension ``"tp"``):

* embedding: ids outside this rank's rows look up zeros; the partial embeddings are
  summed over tp (one all-reduce of b·s·h forward, none backward);
* head: its input enters the tp region (one all-reduce of b·s·h backward) and each rank
  projects only its ``V/T`` logits;
* cross-entropy (:func:`vocab_parallel_cross_entropy`): one max all-reduce of b·s
  floats, then one all-reduce of the b·s pairs (sum of exponentials, target logit); the
  whole logits are never gathered. Its gradient is ``softmax − one-hot`` on the local
  slice, exact.

Who sees what: a zeal GPT/Llama called with ``labels`` computes its loss this way
(:func:`zeal.models.checkpointing.causal_lm_loss` asks the head); a Hugging Face model
called with ``labels=`` keyword gets a replaced ``loss_function`` and its output's
``logits`` are then **this rank's vocabulary slice** (``(..., V/T)``). Called without
labels (generation, evaluation, calibration), the head gathers whole logits (an
all-gather over tp; its gradient takes the local slice back), so every caller that needs
whole logits still gets them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zeal.dist.comm import Comm
from zeal.parallel.tensor import Split, TensorParallel, copy_to_tp, gather_from_tp, reduce_from_tp

__all__ = ["VOCAB", "VocabParallel", "apply_vocab_parallel", "gather_vocab", "vocab_parallel_causal_lm_loss",
           "vocab_parallel_cross_entropy"]

VOCAB = "vocab"  # the Comm kind of vocabulary-parallel traffic


# -- collectives ------------------------------------------------------------------------------
class _VocabCE(torch.autograd.Function):
    """Per-row cross-entropy from this rank's logits slice (N, V/T) and global targets (N,)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, start: int, comm: Comm,  # noqa: D102
                ignore_index: int) -> torch.Tensor:
        n = logits.size(-1)
        big = logits.detach().max(dim=-1).values.contiguous()
        comm.all_reduce(big, VOCAB, op=dist.ReduceOp.MAX)
        shifted = logits.detach() - big.unsqueeze(-1)
        local = target - start
        mine = (local >= 0) & (local < n) & (target != ignore_index)
        idx = local.clamp(0, n - 1).unsqueeze(-1)
        exp = shifted.exp()
        pair = torch.stack((exp.sum(dim=-1), shifted.gather(-1, idx).squeeze(-1) * mine), dim=-1).contiguous()
        comm.all_reduce(pair, VOCAB)
        ignored = target == ignore_index
        loss = (pair[:, 0].log() - pair[:, 1]).masked_fill(ignored, 0.0)
        exp.div_(pair[:, :1])  # the softmax slice, kept for backward
        ctx.save_for_backward(exp, idx, mine, ignored)
        return loss

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: D102
        soft, idx, mine, ignored = ctx.saved_tensors
        grad = soft.clone()
        grad.scatter_add_(-1, idx, -mine.to(grad.dtype).unsqueeze(-1))
        grad.mul_(g.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, start: int, comm: Comm,
                                 ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy`` of the whole logits, from this rank's slice ``logits`` (N, V/T),
    which holds vocabulary ids ``[start, start + V/T)``; ``target`` (N,) are global ids
    (``ignore_index`` rows count zero and are left out of the mean). ``reduction``:
    ``"mean"``, ``"sum"`` or ``"none"``. Collective over ``comm`` (every tp rank calls it
    with its own slice and the same targets); computed in fp32."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"vocab_parallel_cross_entropy: reduction must be mean, sum or none, got {reduction!r}")
    rows = _VocabCE.apply(logits.float(), target, start, comm, ignore_index)
    if reduction == "none":
        return rows
    total = rows.sum()
    return total if reduction == "sum" else total / (target != ignore_index).sum().clamp(min=1)


# -- what was split ---------------------------------------------------------------------------
@dataclass
class VocabParallel:
    """This rank's vocabulary rows ``[start, start + per_rank)`` of ``vocab`` over ``comm``.
    ``local``: whether the head now returns local logits (a Hugging Face forward with labels)."""

    comm: Comm
    size: int
    rank: int
    vocab: int
    local: bool = False

    @property
    def per_rank(self) -> int:
        return self.vocab // self.size

    @property
    def start(self) -> int:
        return self.rank * self.per_rank

    def cross_entropy(self, logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                      reduction: str = "mean") -> torch.Tensor:
        """:func:`vocab_parallel_cross_entropy` over this rank's rows."""
        return vocab_parallel_cross_entropy(logits, target, self.start, self.comm, ignore_index, reduction)


def gather_vocab(local: torch.Tensor, vp: VocabParallel) -> torch.Tensor:
    """Whole logits (..., V) from every rank's slice (..., V/T) (differentiable)."""
    return gather_from_tp(local, vp.comm, vp.rank, -1, VOCAB)


def vocab_parallel_causal_lm_loss(vp: VocabParallel, logits: torch.Tensor, labels: torch.Tensor,
                                  vocab_size: int | None = None, num_items_in_batch=None, ignore_index: int = -100,
                                  shift_labels: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """Hugging Face's causal-LM loss (labels shifted left, the last position ignored; the
    sum over ``num_items_in_batch`` when given, else the mean) from local logits."""
    del vocab_size, kwargs
    if logits.size(-1) != vp.per_rank:
        raise ValueError(f"vocabulary-parallel loss: logits of {logits.size(-1)} columns, expected this rank's "
                         f"{vp.per_rank} (of {vp.vocab})")
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    target = shift_labels.reshape(-1).to(logits.device)
    flat = logits.reshape(-1, logits.size(-1))
    if num_items_in_batch is None:
        return vp.cross_entropy(flat, target, ignore_index)
    total = vp.cross_entropy(flat, target, ignore_index, "sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


# -- the split -------------------------------------------------------------------------------
def _embedding_forward(mod: nn.Embedding, vp: VocabParallel, pad: int | None, ids: torch.Tensor) -> torch.Tensor:
    local = ids - vp.start
    outside = (local < 0) | (local >= vp.per_rank)
    y = F.embedding(local.masked_fill(outside, 0), mod.weight, pad)
    y = y.masked_fill(outside.unsqueeze(-1), 0.0)
    return reduce_from_tp(y, vp.comm, VOCAB)


def _head_forward(mod: nn.Linear, vp: VocabParallel, x: torch.Tensor) -> torch.Tensor:
    local = vocab_local_logits(mod, vp, x)
    return local if vp.local else gather_vocab(local, vp)


def vocab_local_logits(mod: nn.Linear, vp: VocabParallel, x: torch.Tensor) -> torch.Tensor:
    """This rank's logits slice (..., V/T) of a vocabulary-parallel head ``mod``."""
    x = copy_to_tp(x, vp.comm, VOCAB)
    return F.linear(x, mod.weight, mod.bias)


def _find_embedding(model: nn.Module, vocab: int) -> nn.Embedding | None:
    get = getattr(model, "get_input_embeddings", None)
    try:
        emb = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        emb = None
    if emb is None:
        emb = next((m for n, m in model.named_modules() if n.split(".")[-1] in ("wte", "embed_tokens")), None)
    ok = isinstance(emb, nn.Embedding) and type(emb).forward is nn.Embedding.forward
    return emb if ok and emb.num_embeddings == vocab and emb.max_norm is None and not emb.sparse else None


def _find_head(model: nn.Module) -> nn.Linear | None:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    head = head if head is not None else getattr(model, "lm_head", None)
    return head if isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward else None


def _slice_rows(p: nn.Parameter, vp: VocabParallel) -> Split:
    full = tuple(p.shape)
    with torch.no_grad():
        p.data = p.data.narrow(0, vp.start, vp.per_rank).clone()
    return Split(0, full, ((0, vp.start, vp.per_rank),))


def _labels_hook(vp: VocabParallel, module: nn.Module, args: tuple, kwargs: dict) -> None:
    vp.local = kwargs.get("labels") is not None


def _after_hook(vp: VocabParallel, module: nn.Module, args: tuple, kwargs: dict, out):
    vp.local = False
    return out


def apply_vocab_parallel(model: nn.Module, tp: TensorParallel, stage=None) -> VocabParallel | None:
    """Split ``model``'s LM head (an ``nn.Linear`` of ``V`` outputs) and its input embedding
    (``V`` rows; the same Parameter when tied) by vocabulary rows over ``tp``, recording the
    splits in ``tp.splits`` (including a tied alias's name, so state dicts come out whole).
    Returns None, leaving both whole, when the head is not a plain linear or ``tp.size``
    does not divide ``V``. ``stage``: this rank's pipeline stage
    (:class:`zeal.pipe.stages.Stage`), whose part of the pair is split."""
    if stage is not None:
        return _apply_to_stage(model, tp, stage)
    head = _find_head(model)
    if head is None or head.out_features % tp.size:
        return None
    vp = VocabParallel(tp.comm, tp.size, tp.rank, head.out_features)
    split_of: dict[int, Split] = {}
    emb = _find_embedding(model, vp.vocab)
    if emb is not None:
        _split_embedding(emb, vp, split_of)
    _split_head(head, vp, split_of)
    _inject_loss(model, head, vp)
    _record(model, tp, split_of)
    if isinstance(getattr(type(model), "loss_function", None), property):  # a Hugging Face model
        model.loss_function = functools.partial(vocab_parallel_causal_lm_loss, vp)
        model.register_forward_pre_hook(functools.partial(_labels_hook, vp), with_kwargs=True)
        model.register_forward_hook(functools.partial(_after_hook, vp), with_kwargs=True)
    return vp


def _apply_to_stage(model: nn.Module, tp: TensorParallel, stage) -> VocabParallel | None:
    """The first stage's embedding and the last stage's head (zeal's GPT/Llama; every stage
    decides alike from the model's vocabulary); a tied head's copy on the last stage is
    sized to the slice (``stage.tied.shape``)."""
    from zeal.pipe.module import PipelineModule

    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(model, PipelineModule) or not isinstance(vocab, int) or vocab % tp.size:
        return None
    vp = VocabParallel(tp.comm, tp.size, tp.rank, vocab)
    split_of: dict[int, Split] = {}
    tied = stage.tied
    if stage.first:
        emb = _find_embedding(model, vocab)
        if emb is None:
            raise ValueError(f"vocabulary parallelism: no embedding of {vocab} rows on the first pipeline stage")
        _split_embedding(emb, vp, split_of)
        if tied is not None:
            tied.shape = tuple(tied.param.shape)
    if stage.last:
        head = _find_head(model)
        if head is None or head.out_features != vocab:
            raise ValueError(f"vocabulary parallelism: no plain nn.Linear head of {vocab} outputs on the last stage")
        if tied is not None and not stage.first:  # computed with the engine's copy: this rank's rows
            tied.shape = (vp.per_rank, *tied.shape[1:])
        _split_head(head, vp, split_of, weight=tied is None or stage.first)
        _inject_loss(model, head, vp)
    _record(model, tp, split_of)
    return vp


def _split_embedding(emb: nn.Embedding, vp: VocabParallel, split_of: dict[int, Split]) -> None:
    pad = emb.padding_idx
    pad = pad - vp.start if pad is not None and vp.start <= pad < vp.start + vp.per_rank else None
    split_of[id(emb.weight)] = _slice_rows(emb.weight, vp)
    emb.num_embeddings = vp.per_rank
    emb.forward = functools.partial(_embedding_forward, emb, vp, pad)


def _split_head(head: nn.Linear, vp: VocabParallel, split_of: dict[int, Split], weight: bool = True) -> None:
    for p in ((head.weight,) if weight else ()) + (head.bias,):
        if p is not None and id(p) not in split_of:
            split_of[id(p)] = _slice_rows(p, vp)
    head.out_features = vp.per_rank
    head.forward = functools.partial(_head_forward, head, vp)


def _inject_loss(model: nn.Module, head: nn.Linear, vp: VocabParallel) -> None:
    """A zeal model's loss (:func:`zeal.models.checkpointing.causal_lm_loss`) projects this
    rank's slice of the logits and scores it with the vocabulary-parallel cross-entropy."""
    policy = getattr(model, "checkpoint_policy", None)
    if policy is not None:
        policy.logits_loss = (functools.partial(vocab_local_logits, head, vp), vp.cross_entropy)


def _record(model: nn.Module, tp: TensorParallel, split_of: dict[int, Split]) -> None:
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in split_of:
            tp.splits.setdefault(name, split_of[id(p)])
