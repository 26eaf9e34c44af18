"""The per-layer configuration search of NxMiFormer: sensitivity, then an exact choice.

Every compressible layer i gets one :class:`Choice` (an N:M pattern or dense, and a
weight width). Its storage, relative to fp32 and ignoring index metadata, is
``|W_i|·(n/m)·(bits/32)``; the compression ratio of a configuration is
``1 − Σ|W_i|·(n_i/m_i)·(b_i/32) / Σ|W_i|`` (2:4 + int8 → 87.5%, int4 → 87.5%,
2:4 + int4 → 93.75%).

The predicted loss of a configuration is the sum of per-layer sensitivities
(:func:`layer_sensitivity`: the calibration-loss increase when only that layer is
compressed with that choice). :func:`search` minimises it under a ratio budget
exactly, by dynamic programming over the Pareto frontier (cost, loss) of the layers
seen so far: a partial configuration that costs more and predicts a higher loss than
another can never be part of the optimum, so only the frontier is kept. Costs are
integers (weights × n × bits × lcm of the m's / m), so nothing is rounded.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from zeal.compression.nm import nm_project
from zeal.compression.quant import quantize_dequantize

__all__ = ["Choice", "compression_ratio", "exhaustive_search", "layer_sensitivity", "search"]


@dataclass(frozen=True)
class Choice:
    """``n`` of every ``m`` kept (``n == m``: dense) and weight ``bits`` (32: unquantized)."""

    n: int = 1
    m: int = 1
    bits: int = 32

    def __str__(self) -> str:
        return f"{'dense' if self.n == self.m else f'{self.n}:{self.m}'}/{'fp32' if self.bits == 32 else f'int{self.bits}'}"


def compression_ratio(sizes: Sequence[int], choices: Sequence[Choice]) -> float:
    """``1 − Σ|W_i|·(n_i/m_i)·(b_i/32) / Σ|W_i|``."""
    kept = sum(s * c.n / c.m * c.bits / 32 for s, c in zip(sizes, choices))
    return 1.0 - kept / sum(sizes)


def _costs(sizes: Sequence[int], options: Sequence[Sequence[Choice]]) -> tuple[list[list[int]], int]:
    """Integer costs per layer and option, and the scale: cost = size·n·bits·L/m, with
    L the lcm of every m, so that fp32 dense costs size·32·L."""
    lcm = 1
    for opts in options:
        for c in opts:
            lcm = lcm * c.m // math.gcd(lcm, c.m)
    return [[s * c.n * c.bits * (lcm // c.m) for c in opts] for s, opts in zip(sizes, options)], 32 * lcm


def search(sizes: Sequence[int], options: Sequence[Sequence[Choice]], loss: Sequence[Sequence[float]],
           min_ratio: float) -> tuple[list[Choice], float]:
    """The choice per layer minimising ``Σ loss[i][j]`` with ``compression_ratio >= min_ratio``
    (ties: the cheaper, then the earlier option). Returns (choices, predicted loss)."""
    costs, unit = _costs(sizes, options)
    budget = math.floor((1.0 - min_ratio) * sum(sizes) * unit + 1e-9)
    frontier: list[tuple[int, float, tuple[int, ...]]] = [(0, 0.0, ())]  # (cost, loss, picks), cost ascending
    for i in range(len(sizes)):
        cand = [(c + costs[i][j], v + loss[i][j], picks + (j,))
                for c, v, picks in frontier for j in range(len(options[i])) if c + costs[i][j] <= budget]
        cand.sort(key=lambda t: (t[0], t[1]))
        frontier = []
        for t in cand:  # keep a state only if it predicts a lower loss than every cheaper one
            if not frontier or t[1] < frontier[-1][1]:
                frontier.append(t)
        if not frontier:
            raise ValueError(f"no configuration reaches a compression ratio of {min_ratio:.4f}")
    cost, value, picks = min(frontier, key=lambda t: (t[1], t[0]))
    del cost
    return [options[i][j] for i, j in enumerate(picks)], value


def exhaustive_search(sizes: Sequence[int], options: Sequence[Sequence[Choice]], loss: Sequence[Sequence[float]],
                      min_ratio: float) -> tuple[list[Choice], float]:
    """The same optimum by trying every configuration (for tests; exponential)."""
    import itertools

    best: tuple[float, list[Choice]] | None = None
    for picks in itertools.product(*[range(len(o)) for o in options]):
        chosen = [options[i][j] for i, j in enumerate(picks)]
        if compression_ratio(sizes, chosen) < min_ratio - 1e-12:
            continue
        v = sum(loss[i][j] for i, j in enumerate(picks))
        if best is None or v < best[0]:
            best = (v, chosen)
    if best is None:
        raise ValueError(f"no configuration reaches a compression ratio of {min_ratio:.4f}")
    return best[1], best[0]


def apply_choice(w: torch.Tensor, c: Choice) -> torch.Tensor:
    """``w`` compressed by ``c``: projected to N:M, then quantized per output channel."""
    out = nm_project(w, c.n, c.m) if c.n < c.m else w
    return quantize_dequantize(out, c.bits) if c.bits < 32 else out


@torch.no_grad()
def layer_sensitivity(model: nn.Module, targets: dict[str, nn.Linear], options: Sequence[Choice],
                      loss_fn: Callable[[nn.Module], float]) -> list[list[float]]:
    """``[layer][option]``: the calibration loss with only that layer compressed by that
    option, minus the loss of the uncompressed model (``loss_fn(model)`` evaluates)."""
    base = loss_fn(model)
    table = []
    for lin in targets.values():
        saved = lin.weight.detach().clone()
        row = []
        for c in options:
            lin.weight.copy_(apply_choice(saved, c))
            row.append(loss_fn(model) - base)
        lin.weight.copy_(saved)
        table.append(row)
    return table
