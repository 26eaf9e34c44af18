"""Padding-free training passes (``rlhf.padding_free``): a batch of sequences of different
lengths is concatenated into one row of ``N = Σ L_i`` tokens, positions restart at 0 for
each sequence, and every sequence attends causally over itself only (attention per
sequence segment, the block-diagonal causal mask without materialising it). No token of
padding is computed, and each sequence's logits — hence its per-token log-probs, losses
and gradients — are those of the padded batch (to float rounding).

:func:`packed_logprobs` returns the per-action log-probs in the padded layout of
:func:`zeal.rlhf.formulas.token_logprobs` (``(B, T_max − 1)``, zeros past each row's end),
so the SFT, DPO and GRPO losses read them unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zeal.rlhf.batch import entropy_of


@dataclass
class PackedRows:
    """``ids (1, N)`` the concatenated sequences, ``positions (1, N)`` restarting per
    sequence, ``bounds`` each sequence's ``[start, end)`` in the row."""

    ids: torch.Tensor
    positions: torch.Tensor
    bounds: list[tuple[int, int]]


def pack_rows(rows: list[list[int]], device: torch.device | str = "cpu") -> PackedRows:
    """Concatenate token-id lists (each non-empty) into one padding-free row."""
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("pack_rows: every sequence needs at least one token")
    bounds, s = [], 0
    for r in rows:
        bounds.append((s, s + len(r)))
        s += len(r)
    ids = torch.tensor([t for r in rows for t in r], dtype=torch.long, device=device)[None]
    pos = torch.cat([torch.arange(e - b, device=device) for b, e in bounds])[None]
    return PackedRows(ids, pos, bounds)


class SegmentAttention:
    """Causal attention within each ``[start, end)`` segment of a ``(1, N)`` row (the
    block-diagonal causal mask): one scaled-dot-product call per segment. Torch ops only
    (training and reference forwards)."""

    ops = None

    def __init__(self, bounds: list[tuple[int, int]]) -> None:
        self.bounds = bounds

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 dropout_p: float = 0.0) -> torch.Tensor:
        # q (1, N, nh, hd), k/v (1, N, nkv, hd)
        rep = q.shape[-2] // k.shape[-2]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=-2), v.repeat_interleave(rep, dim=-2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (1, nh, N, hd)
        outs = [F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True,
                                               dropout_p=dropout_p) for s, e in self.bounds]
        return torch.cat(outs, dim=2).transpose(1, 2)


def packed_logprobs(model: nn.Module, rows: list[list[int]], start: int = 0, with_entropy: bool = False,
                    width: int | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-action log-probs of ``rows`` (token-id lists) from one padding-free forward of
    ``model`` (a zeal ``Llama``/``GPT`` or a TrainEngine over one), in the padded layout
    ``(B, T_max − 1 − start)``: entry ``[i, t]`` is the log-prob of ``rows[i][start + t + 1]``
    (0 past the row's end). Only the actions ``≥ start`` are projected by the LM head.
    ``with_entropy``: also each action's next-token entropy (no grad). ``width``: the
    layout's width when wider (a micro-batch of a larger padded batch)."""
    p = pack_rows(rows, next(_params(model)).device)
    width = max(max(len(r) for r in rows) - 1 - start, width or 0)
    # flat positions of the projected actions, and where each lands in the padded layout
    src, dst_row, dst_col, tgt = [], [], [], []
    for i, (s, e) in enumerate(p.bounds):
        n = max(0, (e - s) - 1 - start)
        src.append(torch.arange(s + start, s + start + n))
        dst_row.append(torch.full((n,), i))
        dst_col.append(torch.arange(n))
        tgt.append(torch.arange(s + start + 1, s + start + 1 + n))
    src, dst_row, dst_col, tgt = (torch.cat(x).to(p.ids.device) for x in (src, dst_row, dst_col, tgt))
    logits = model(p.ids, positions=p.positions, attention=SegmentAttention(p.bounds), logits_index=src)
    lp = torch.log_softmax(logits[0].float(), dim=-1)  # (n_actions, V)
    picked = lp.gather(-1, p.ids[0, tgt].unsqueeze(-1)).squeeze(-1)
    out = torch.zeros(len(rows), max(width, 0), device=lp.device, dtype=lp.dtype)
    out = out.index_put((dst_row, dst_col), picked)
    if not with_entropy:
        return out
    ent = torch.zeros_like(out.detach())
    ent[dst_row, dst_col] = entropy_of(lp)
    return out, ent


def _params(model: nn.Module):
    return getattr(model, "module", model).parameters()
