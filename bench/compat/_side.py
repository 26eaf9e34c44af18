"""What every comparison script shares: which ``deepspeed`` it runs on, the synthetic
data sets, and the one line of results it prints for ``run.py``.

``COMPAT_SIDE=zeal`` runs a script on zeal, anything else on DeepSpeed itself (its own
virtual environment). Plain file with no zeal import, so DeepSpeed's environment loads it."""

from __future__ import annotations

import json
import os
import time

import torch


def import_deepspeed():
    """The ``deepspeed`` module of this side (the one line a user changes)."""
    if os.environ.get("COMPAT_SIDE") == "zeal":
        import zeal.deepspeed as deepspeed
    else:
        import deepspeed
        import deepspeed.moe.utils  # noqa: F401  (a submodule scripts reach as an attribute)
    return deepspeed


class Tensors(torch.utils.data.Dataset):
    """A fixed synthetic data set: rows of tensors drawn from one seeded generator."""

    def __init__(self, *columns: torch.Tensor) -> None:
        self.columns = columns

    def __len__(self) -> int:
        return len(self.columns[0])

    def __getitem__(self, i: int):
        return tuple(c[i] for c in self.columns)


def images(n: int, classes: int = 10, seed: int = 0) -> Tensors:
    """CIFAR-10-shaped images (3×32×32, normalised) with labels."""
    g = torch.Generator().manual_seed(seed)
    return Tensors(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, classes, (n,), generator=g))


def tokens(n: int, seq: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Token ids with a learnable pattern (each row counts up from a random start)."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    noise = (torch.rand(n, seq, generator=g) < 0.1) * torch.randint(0, vocab, (n, seq), generator=g)
    return (start + torch.arange(seq) + noise) % vocab


class Recorder:
    """Per-step losses and wall times of rank 0, printed as one ``COMPAT_RESULT`` line."""

    def __init__(self, rank: int) -> None:
        self.rank, self.losses, self.times = rank, [], []
        self._t = time.perf_counter()

    def step(self, loss: float) -> None:
        now = time.perf_counter()
        self.losses.append(float(loss))
        self.times.append(now - self._t)
        self._t = now
        if self.rank == 0:
            print(f"step {len(self.losses) - 1} loss {float(loss):.6f}", flush=True)

    def finish(self, **extra) -> None:
        if self.rank == 0:
            steady = self.times[2:] or self.times  # the first steps build and warm up
            print("COMPAT_RESULT " + json.dumps({"losses": self.losses, "step_s": sum(steady) / len(steady),
                                                 "side": os.environ.get("COMPAT_SIDE", "deepspeed"), **extra}),
                  flush=True)
