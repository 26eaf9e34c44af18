"""DeepSpeed-Ulysses attention: each rank holds 1/S of every sequence; attention sees all of it.

Every layer's q, k and v come in sequence-sharded, ``(B, T/S, H, D)`` on each of the S
ranks of ``mesh.sp``. One all-to-all per tensor regroups them head-sharded,
``(B, T, H/S, D)``: every token of the sequence, 1/S of the heads. Attention then runs
locally (causal over the global positions, since the chunks are regrouped in rank
order), and one all-to-all takes the output back to ``(B, T/S, H, D)``. Per attention
layer that is 4 all-to-alls of ``b·s·h/S`` elements each (q, k, v, out; fewer for GQA's
k/v) in forward and the same 4 in backward (each all-to-all's gradient is the inverse
all-to-all), all on the ``sp`` Comm under kind "sequence".

Grouped-query attention: key/value heads are split like the query heads when S divides
them; when S exceeds them (``S % nkv == 0``) each k/v head is first repeated ``S / nkv``
times, as DeepSpeed's ``UlyssesSPAttentionHF`` does, so each rank receives the one k/v
head its query heads read.

Applied, never inside the model: zeal's GPT and Llama take the attention object as an
argument (:class:`UlyssesAttention` wraps dense causal attention); Hugging Face models get
a wrapping function registered in transformers' attention registry and selected through
``config._attn_implementation`` (:func:`register_hf_attention`), their code untouched.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from zeal.dist.comm import Comm
from zeal.models.attention import dense_causal_attention

KIND = "sequence"  # the CommStats kind of the Ulysses all-to-alls
HF_NAME = "zeal_ulysses"  # the attention implementation registered with transformers


def _exchange(comm: Comm, chunks: torch.Tensor) -> torch.Tensor:
    """All-to-all of ``chunks`` (S, ...): chunk j goes to sp rank j; returns what every rank
    sent this rank, in rank order (S, ...)."""
    chunks = chunks.contiguous()
    out = torch.empty_like(chunks)  # contiguous like chunks (empty_like keeps a permuted layout)
    comm.all_to_all(out, chunks, KIND)
    return out


def _seq_to_heads(comm: Comm, x: torch.Tensor) -> torch.Tensor:
    # (B, T/S, H, D) -> chunks (S, B, T/S, H/S, D) by head block -> (B, T, H/S, D) in rank order
    s = comm.size
    b, t, h, d = x.shape
    got = _exchange(comm, x.reshape(b, t, s, h // s, d).permute(2, 0, 1, 3, 4))
    return got.permute(1, 0, 2, 3, 4).reshape(b, s * t, h // s, d)


def _heads_to_seq(comm: Comm, y: torch.Tensor) -> torch.Tensor:
    # (B, T, H/S, D) -> chunks (S, B, T/S, H/S, D) by token block -> (B, T/S, H, D) in head order
    s = comm.size
    b, t, h, d = y.shape
    got = _exchange(comm, y.reshape(b, s, t // s, h, d).permute(1, 0, 2, 3, 4))
    return got.permute(1, 2, 0, 3, 4).reshape(b, t // s, s * h, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return _seq_to_heads(comm, x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _heads_to_seq(ctx.comm, g), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return _heads_to_seq(comm, y)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _seq_to_heads(ctx.comm, g), None


def seq_to_heads(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """``(B, T/S, H, D)`` sequence-sharded -> ``(B, T, H/S, D)`` head-sharded (differentiable)."""
    return _SeqToHeads.apply(x, comm) if comm.active else x


def heads_to_seq(y: torch.Tensor, comm: Comm) -> torch.Tensor:
    """The inverse of :func:`seq_to_heads` (differentiable)."""
    return _HeadsToSeq.apply(y, comm) if comm.active else y


def check_heads(n_heads: int, n_kv: int, sp: int) -> None:
    """Raise ValueError unless ``sp`` splits the (local) query heads and divides or is a
    multiple of the key/value heads."""
    if n_heads % sp:
        raise ValueError(f"sequence_parallel_size {sp} does not divide the {n_heads} attention heads "
                         "(per tensor-parallel rank)")
    if n_kv % sp and sp % n_kv:
        raise ValueError(f"sequence_parallel_size {sp} neither divides nor is a multiple of the {n_kv} "
                         "key/value heads (per tensor-parallel rank)")


def ulysses_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                comm: Comm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``(B, T/S, nh, D)``, k/v ``(B, T/S, nkv, D)`` -> head-sharded over all T tokens;
    k/v heads repeated to S first when S exceeds them (see the module docstring)."""
    s = comm.size
    check_heads(q.shape[-2], k.shape[-2], s)
    nkv = k.shape[-2]
    if nkv % s:
        k, v = k.repeat_interleave(s // nkv, dim=-2), v.repeat_interleave(s // nkv, dim=-2)
    return seq_to_heads(q, comm), seq_to_heads(k, comm), seq_to_heads(v, comm)


class UlyssesAttention:
    """zeal's attention protocol (:mod:`zeal.models.attention`) for a sequence-sharded
    batch ``(B, T/S, ...)``: all-to-all to heads, dense causal attention over the whole
    sequence, all-to-all back. Stateless, so an activation-checkpointed layer may run it
    again in backward (its all-to-alls then run again too)."""

    ops = None  # torch ops (autograd) only

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 dropout_p: float = 0.0) -> torch.Tensor:
        if q.dim() != 4:
            raise ValueError("sequence parallelism needs a (batch, tokens) input, not a flat serving batch")
        q, k, v = ulysses_qkv(q, k, v, self.comm)
        return heads_to_seq(dense_causal_attention(q, k, v, dropout_p), self.comm)


def register_hf_attention(model: Any, comm: Comm) -> str:
    """Route a transformers model's attention through Ulysses: a function bound to ``comm``
    is registered in transformers' ``AttentionInterface`` (as ``"zeal_ulysses_<ranks>"``)
    and selected by setting the model's ``config._attn_implementation``; the model's code
    is untouched. The function takes HF's ``(B, H, T/S, D)`` q/k/v, runs causal SDPA over
    the gathered sequence with the layer's ``scaling`` and returns HF's ``(B, T/S, H, D)``
    output. Returns the registered name."""
    import functools

    from transformers import AttentionInterface

    name = f"{HF_NAME}_" + "_".join(map(str, comm.ranks))
    AttentionInterface.register(name, functools.partial(_hf_attention, comm))
    for sub in model.modules():  # the model's config and those of composite models' parts
        cfg = getattr(sub, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = name
    return name


def _hf_attention(comm: Comm, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
    # HF: (B, H, T/S, D) -> zeal's (B, T/S, H, D); the local causal mask HF may pass is not
    # the global one, so causality is SDPA's over the gathered sequence
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    q, k, v = ulysses_qkv(q, k, v, comm)
    window = kwargs.get("sliding_window")
    if window and q.shape[1] > window:
        raise ValueError(f"sequence parallelism runs full causal attention: {q.shape[1]} tokens exceed this "
                         f"model's sliding_window {window}")
    rep = q.shape[-2] // k.shape[-2]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=-2), v.repeat_interleave(rep, dim=-2)
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                       dropout_p=dropout if module.training else 0.0, scale=scaling)
    return heads_to_seq(y.transpose(1, 2), comm).contiguous(), None
