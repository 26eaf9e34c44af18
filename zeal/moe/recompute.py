"""Communication-aware activation checkpointing (DeepSpeed-TED): the recompute of a
checkpointed MoE layer reuses the all-to-all outputs saved in forward.

Plain checkpointing runs a group's forward twice: once in forward, once in backward to
rebuild what autograd needs, and each MoE layer inside issues its two expert-parallel
all-to-alls both times. Under :func:`comm_aware` the first run keeps every all-to-all
output of its MoE layers (detached, in call order) and a later run of the same call takes
them back in the same order instead of communicating: its ``all_to_all`` is an autograd
node whose forward returns the saved tensor and whose backward is the ordinary
all-to-all of the gradient (``drop_tokens=False``'s capacity, agreed over ep, is reused
too). One all-to-all pair per MoE layer and step less, for the memory of the saved outputs (held until the group's backward is done). The
recomputation reruns the gating with the same random state (checkpointing restores it),
so the routing, and the buffers the saved outputs belong to, are the same.

zeal's models wrap each checkpointed group when ``activation_checkpointing``'s
``communication_aware`` is true; a model that calls ``torch.utils.checkpoint`` itself
wraps its function per forward: ``checkpoint(comm_aware(fn), x, use_reentrant=False)``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from zeal.dist.comm import Comm

_state = threading.local()  # the call being run (recomputation runs in backward's thread)


class SavedExchanges:
    """The all-to-all outputs of one checkpointed call: filled by its first run, read back
    in order by every later run (a recomputation that stops early reads fewer)."""

    def __init__(self) -> None:
        self.outputs: list[torch.Tensor] = []
        self.scalars: list[float] = []  # values agreed over a group (drop_tokens=False's capacity)
        self.replaying = False
        self.cursor = self.scalar_cursor = 0

    def start(self, replay: bool) -> None:
        self.replaying, self.cursor, self.scalar_cursor = replay, 0, 0

    def next_scalar(self) -> float:
        if self.scalar_cursor >= len(self.scalars):
            raise RuntimeError("communication-aware checkpointing: the recomputation agreed more values over the "
                               "expert-parallel group than the forward")
        self.scalar_cursor += 1
        return self.scalars[self.scalar_cursor - 1]

    def next(self) -> torch.Tensor:
        if self.cursor >= len(self.outputs):
            raise RuntimeError("communication-aware checkpointing: the recomputation issued more MoE all-to-alls "
                               f"than the forward ({len(self.outputs)}); the checkpointed function must run the "
                               "same MoE layers in the same order each time")
        out = self.outputs[self.cursor]
        self.cursor += 1
        return out


def comm_aware(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``fn`` whose first call records its MoE all-to-all outputs and whose later calls
    (checkpointing's recomputation) reuse them. Wrap once per forward (one saved set per call)."""
    saved = SavedExchanges()
    calls = 0

    def run(*args: object, **kwargs: object) -> torch.Tensor:
        nonlocal calls
        saved.start(replay=calls > 0)
        calls += 1
        outer = getattr(_state, "saved", None)
        _state.saved = saved
        try:
            return fn(*args, **kwargs)
        finally:
            _state.saved = outer

    return run


class _Replayed(torch.autograd.Function):
    """Forward: the saved all-to-all output (no communication); backward: the all-to-all
    of the gradient, as the original exchange's backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, out: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.comm = comm
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        ctx.comm.all_to_all(out, grad, "moe")
        return out, None, None


def agreed(compute: Callable[[], float]) -> float:
    """``compute()`` (a scalar collective, e.g. the largest expert count over ep), recorded
    or replayed like the all-to-alls when a :func:`comm_aware` call is running."""
    saved: SavedExchanges | None = getattr(_state, "saved", None)
    if saved is None:
        return compute()
    if saved.replaying:
        return saved.next_scalar()
    value = compute()
    saved.scalars.append(value)
    return value


def exchange(comm: Comm | None, x: torch.Tensor, all_to_all: Callable) -> torch.Tensor:
    """``all_to_all(comm, x)``, recorded or replayed when a :func:`comm_aware` call is
    running and ``comm`` spans more than one rank."""
    saved: SavedExchanges | None = getattr(_state, "saved", None)
    if saved is None or comm is None or not comm.active:
        return all_to_all(comm, x)
    if saved.replaying:
        out = saved.next()
        if out.shape != x.shape:
            raise RuntimeError(f"communication-aware checkpointing: recomputed all-to-all input {tuple(x.shape)} "
                               f"differs from the forward's {tuple(out.shape)}")
        return _Replayed.apply(x, comm, out)
    out = all_to_all(comm, x)
    saved.outputs.append(out.detach())
    return out
