"""Calibration and evaluation text, token blocks and perplexity.

With no ``--data``, the text is Python's own documentation topics (``pydoc_data``,
shipped with every CPython): topics are sorted by name and every fifth goes to the
evaluation part, the rest to calibration and fine-tuning, so the two never share a
topic. A ``--data FILE`` is split the same way by paragraphs (blank-line separated).
:func:`split_three` further splits the non-evaluation part: the fourth of every five
pieces is calibration (Wanda's activation norms, the search's probe), the first three
fine-tuning, so calibration, fine-tuning and evaluation text share no piece.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

__all__ = ["blocks", "model_logits", "perplexity", "split_text", "split_three"]

EVAL_EVERY = 5


def _pieces(path: str | Path | None) -> list[str]:
    if path is None:
        from pydoc_data.topics import topics

        pieces = [topics[k] for k in sorted(topics)]
    else:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"--data {str(p)!r} is not a file")
        pieces = [x for x in p.read_text(encoding="utf-8", errors="replace").split("\n\n") if x.strip()]
        if len(pieces) < 2:
            raise ValueError(f"--data {str(p)!r}: need at least two paragraphs (blank-line separated)")
    return pieces


def split_text(path: str | Path | None = None) -> tuple[str, str]:
    """``(calibration, evaluation)`` text: pydoc topics, or a file's paragraphs."""
    pieces = _pieces(path)
    calib = [x for i, x in enumerate(pieces) if i % EVAL_EVERY != EVAL_EVERY - 1]
    evals = [x for i, x in enumerate(pieces) if i % EVAL_EVERY == EVAL_EVERY - 1] or pieces[-1:]
    return "\n\n".join(calib), "\n\n".join(evals)


def split_three(path: str | Path | None = None) -> tuple[str, str, str]:
    """``(calibration, fine-tuning, evaluation)`` text, disjoint by piece (topic or
    paragraph): piece ``i`` is evaluation when ``i % 5 == 4``, calibration when
    ``i % 5 == 3``, fine-tuning otherwise. Needs at least five pieces."""
    pieces = _pieces(path)
    if len(pieces) < EVAL_EVERY:
        raise ValueError(f"--data {str(path)!r}: need at least {EVAL_EVERY} paragraphs for three parts")
    parts: tuple[list[str], list[str], list[str]] = ([], [], [])
    for i, x in enumerate(pieces):
        r = i % EVAL_EVERY
        parts[2 if r == EVAL_EVERY - 1 else 0 if r == EVAL_EVERY - 2 else 1].append(x)
    return "\n\n".join(parts[0]), "\n\n".join(parts[1]), "\n\n".join(parts[2])


def blocks(ids: list[int], seq_len: int, max_blocks: int | None = None) -> torch.Tensor:
    """Consecutive non-overlapping blocks ``[count, seq_len]`` of a token stream."""
    count = len(ids) // seq_len
    if max_blocks is not None:
        count = min(count, max_blocks)
    if count == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one block of {seq_len}")
    return torch.tensor(ids[:count * seq_len], dtype=torch.long).view(count, seq_len)


def model_logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The logits of ``model(x)``, whether it returns them or an output carrying ``.logits``."""
    out = model(x)
    return out.logits if hasattr(out, "logits") else out


@torch.no_grad()
def perplexity(model: nn.Module, data: torch.Tensor, batch: int = 4,
               logits: Callable[[nn.Module, torch.Tensor], torch.Tensor] = model_logits) -> float:
    """exp(mean next-token cross-entropy) over every block of ``data``."""
    was = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, data.shape[0], batch):
        x = data[i:i + batch]
        lg = logits(model, x)[:, :-1].float()
        loss = nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
        total += float(loss)
        count += x[:, 1:].numel()
    model.train(was)
    return float(torch.exp(torch.tensor(total / count)))
