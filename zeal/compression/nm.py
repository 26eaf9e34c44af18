"""N:M semi-structured sparsity: pure functions of tensors.

Names, defined once (the papers disagree): a pattern ``N:M`` keeps ``n`` weights of every
group of ``m`` consecutive weights along the *input* dimension, NVIDIA's 2:4 being
``n=2, m=4`` (density n/m). The input dimension is the GEMM reduction dimension the
hardware groups over: the last one of an ``nn.Linear`` weight ``[out, in]`` (``dim=-1``),
the first one of a GPT-2 ``Conv1D`` weight ``[in, out]`` (``dim=0``).

:func:`nm_project` is the Euclidean projection onto the set of N:M-sparse tensors: in
every group keep the n entries of largest ``|w|``, zero the others. It is the nearest
feasible point because the squared distance to a candidate support is the sum of the
squares of the dropped entries, minimised by dropping the smallest. Ties are broken by
index (the lower index is kept), so the projection is deterministic and idempotent.
"""

from __future__ import annotations

import torch

from zeal.config.compression import parse_pattern  # the config validates patterns with it

__all__ = ["parse_pattern", "nm_mask", "nm_project", "group_density", "check_groupable"]


def check_groupable(shape: tuple[int, ...], m: int, dim: int = -1, name: str = "weight") -> None:
    """ValueError unless the grouped dimension of ``shape`` is a multiple of ``m``."""
    if not shape:
        raise ValueError(f"{name}: a scalar has no N:M groups")
    size = shape[dim]
    if size % m:
        raise ValueError(f"{name}: dimension {dim} of shape {tuple(shape)} ({size}) is not a multiple of M={m}")


def _groups(t: torch.Tensor, m: int, dim: int) -> torch.Tensor:
    """``t`` with ``dim`` moved last and split into groups: shape (..., size/m, m)."""
    moved = t.movedim(dim, -1)
    return moved.reshape(*moved.shape[:-1], moved.shape[-1] // m, m)


def _ungroup(g: torch.Tensor, like: torch.Tensor, dim: int) -> torch.Tensor:
    moved_shape = like.movedim(dim, -1).shape
    return g.reshape(moved_shape).movedim(-1, dim)


def nm_mask(scores: torch.Tensor, n: int, m: int, dim: int = -1) -> torch.Tensor:
    """Boolean mask keeping, in every group of ``m`` along ``dim``, the ``n`` entries of
    largest score (ties: lower index kept). ``scores`` is ``|w|`` for magnitude pruning
    and the projection, ``|w|·‖x‖`` for Wanda."""
    check_groupable(tuple(scores.shape), m, dim)
    g = _groups(scores.detach(), m, dim)  # (..., groups, m)
    order = torch.sort(g, dim=-1, descending=True, stable=True).indices[..., :n]
    keep = torch.zeros(g.shape, dtype=torch.bool, device=g.device)
    keep.scatter_(-1, order, True)
    return _ungroup(keep, scores, dim)


def nm_project(w: torch.Tensor, n: int, m: int, dim: int = -1) -> torch.Tensor:
    """The Euclidean projection of ``w`` onto N:M-sparse tensors (a new tensor)."""
    return w * nm_mask(w.abs(), n, m, dim)


def group_density(mask: torch.Tensor, m: int, dim: int = -1) -> torch.Tensor:
    """Kept entries per group (shape ``(..., groups)``), for checking a mask is exactly N:M."""
    return _groups(mask.to(torch.int64), m, dim).sum(-1)
