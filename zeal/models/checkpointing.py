"""Activation checkpointing for zeal's models: which blocks recompute in backward, and how.

A model that mixes in :class:`Checkpointable` holds one :class:`CheckpointPolicy`
and runs its layer stack through :func:`run_blocks`. With the policy on, and only
in a training forward with grad enabled, each group of ``every`` consecutive
blocks runs under ``torch.utils.checkpoint.checkpoint``: the group's input is
saved, the activations inside it are dropped and recomputed when backward reaches
the group. Activation memory goes from every block's interior to one boundary
tensor per group plus one group's interior during its backward, for one more
forward of the blocks. Serving (grad off) and evaluation never checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

log = logging.getLogger("zeal")
_said: set[str] = set()


def _log_once(msg: str) -> None:
    if msg not in _said:
        _said.add(msg)
        log.info(msg)


@dataclass
class RecomputeCounter:
    """Totals of the recomputation done in backward (filled only with ``profile`` on)."""

    recompute_s: float = 0.0
    num_recomputes: int = 0
    _logged: int = field(default=0, repr=False)

    def add(self, seconds: float) -> None:
        self.recompute_s += seconds
        self.num_recomputes += 1

    def reset(self) -> None:
        self.recompute_s, self.num_recomputes, self._logged = 0.0, 0, 0

    def log_new(self) -> None:
        """Log the totals at debug level if groups were recomputed since the last call."""
        if self.num_recomputes > self._logged:
            self._logged = self.num_recomputes
            log.debug("activation checkpointing: %d group recomputations, %.4f s in total",
                      self.num_recomputes, self.recompute_s)


@dataclass
class CheckpointPolicy:
    """How a layer stack checkpoints, and how its loss is taken. ``every``: blocks per
    checkpointed group (the last group may be shorter); ``cpu_checkpointing``: keep the
    group inputs in pinned CPU memory (CUDA only); ``profile``: time recomputation into
    ``counter``.

    Injected by the apply-steps (the model knows no parallelism): ``recompute``, wrappers
    put around each checkpointed group's function, in order, so that the recomputation
    sees what the forward saw (tensor parallelism's RNG streams,
    :meth:`zeal.parallel.rng.RNGTracker.replayable`; MoE's saved all-to-alls,
    :func:`zeal.moe.recompute.comm_aware`); ``logits_loss``, ``(project, cross_entropy)``
    used by :func:`causal_lm_loss` instead of ``(head, F.cross_entropy)`` (vocabulary
    parallelism: this rank's slice of the logits and the cross-entropy over the slices,
    :mod:`zeal.parallel.vocab`); ``loss_shards``: the loss is
    :func:`zeal.models.tiled.tiled_logits_loss` over that many tiles (or ``"auto"``), set by
    the ``tiling`` section (:mod:`zeal.train.tiling`); ``hold_params``: ZeRO-3's context that
    keeps the head gathered over the tiled loss's tile loop (``tiled_logits_loss``'s ``hold``)."""

    enabled: bool = False
    every: int = 1
    cpu_checkpointing: bool = False
    profile: bool = False
    use_reentrant: bool = False
    loss_shards: int | str | None = None  # tiles of the tiled logits loss (zeal.models.tiled); None = off
    counter: RecomputeCounter = field(default_factory=RecomputeCounter, compare=False)
    recompute: tuple[Callable[[Callable], Callable], ...] = ()
    logits_loss: tuple[Callable, Callable] | None = field(default=None, compare=False)
    hold_params: Callable | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"checkpoint policy: every must be >= 1, got {self.every}")


def blocks_per_checkpoint(n_blocks: int, number_checkpoints: int | None) -> int:
    """DeepSpeed's ``number_checkpoints`` (checkpoints over the whole stack) as blocks
    per group: ``ceil(n_blocks / number_checkpoints)``; None = every block."""
    if not number_checkpoints or n_blocks <= 0:
        return 1
    return max(1, -(-n_blocks // number_checkpoints))


def run_blocks(blocks: Sequence[nn.Module], x: torch.Tensor, policy: CheckpointPolicy,
               *extra: object) -> torch.Tensor:
    """``x = block(x, *extra)`` for each block in order, checkpointed as ``policy`` says
    when grad is enabled and the blocks are training; otherwise a plain loop."""
    blocks = list(blocks)
    if not (policy.enabled and torch.is_grad_enabled() and any(b.training for b in blocks)):
        for b in blocks:
            x = b(x, *extra)
        return x
    if policy.profile:
        policy.counter.log_new()  # what the previous backward recomputed
    for start in range(0, len(blocks), policy.every):
        fn = _group(blocks[start:start + policy.every])
        for wrap in policy.recompute:  # what the forward's state was (injected by the apply-steps)
            fn = wrap(fn)
        if policy.profile:
            fn = _timed(fn, policy.counter, sync=x.is_cuda)
        with _boundary_storage(policy, x):
            x = checkpoint(fn, x, *extra, use_reentrant=policy.use_reentrant)
    return x


# Elements of one chunk's logits in :func:`causal_lm_loss` (32 MiB in fp32): the largest
# transient of the loss's backward is about three of them (logits, their log-softmax, its gradient).
LOSS_CHUNK_ELEMS = 1 << 23


def causal_lm_loss(head: nn.Module, h: torch.Tensor, labels: torch.Tensor, policy: CheckpointPolicy) -> torch.Tensor:
    """Mean next-token cross-entropy of ``head(h)`` against ``labels`` (shifted inside;
    ``-100`` ignored). Under an active ``policy`` the logits are never whole: chunks of
    rows are projected, scored and summed, each chunk checkpointed, so what is kept for
    backward is ``h`` alone (not the b·s·V fp32 log-softmax) and backward recomputes one
    chunk's logits at a time. Same value as the plain path up to summation order. The
    policy's ``logits_loss`` (vocabulary parallelism) replaces the head's projection and
    the cross-entropy."""
    project, ce = policy.logits_loss or (head, F.cross_entropy)
    if policy.loss_shards is not None:  # ALST's tiled loss: (sum, count) over tiles of rows, exact mean
        from zeal.models.tiled import tiled_logits_loss

        targets = F.pad(labels[:, 1:], (0, 1), value=-100)  # next-token targets; the last position scores none
        total, count = tiled_logits_loss(project, h, targets, policy.loss_shards, params=list(head.parameters()),
                                         cross_entropy=ce, vocab=_out_features(head, h), hold=policy.hold_params)
        return total / count.clamp(min=1)
    if not (policy.enabled and torch.is_grad_enabled() and head.training):
        logits = project(h)
        return ce(logits[:, :-1].reshape(-1, logits.size(-1)).float(), labels[:, 1:].reshape(-1), ignore_index=-100)
    hs = h[:, :-1].reshape(-1, h.size(-1))
    ys = labels[:, 1:].reshape(-1)
    rows = max(1, LOSS_CHUNK_ELEMS // _out_features(head, h))
    total = None
    for start in range(0, hs.size(0), rows):
        part = checkpoint(_chunk_loss, project, ce, hs[start:start + rows], ys[start:start + rows],
                          use_reentrant=False)
        total = part if total is None else total + part
    return total / (ys != -100).sum().clamp(min=1)


def _chunk_loss(project: Callable, ce: Callable, hc: torch.Tensor, yc: torch.Tensor) -> torch.Tensor:
    return ce(project(hc).float(), yc, ignore_index=-100, reduction="sum")


def _out_features(head: nn.Module, h: torch.Tensor) -> int:
    n = getattr(head, "out_features", None)
    return int(n) if n else int(head(h[:1, :1]).size(-1))


def _group(group: list[nn.Module]) -> Callable[..., torch.Tensor]:
    def run(x: torch.Tensor, *extra: object) -> torch.Tensor:
        for b in group:
            x = b(x, *extra)
        return x

    return run


def _timed(fn: Callable[..., torch.Tensor], counter: RecomputeCounter, sync: bool) -> Callable[..., torch.Tensor]:
    """``fn`` whose calls after the first (the recomputations in backward) add their wall
    time to ``counter``. A recomputation may stop early by raising (torch's early stop
    once every saved tensor is back), hence the ``finally``."""
    calls = 0

    def run(*args: object) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == 1:
            return fn(*args)
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            if sync:
                torch.cuda.synchronize()
            counter.add(time.perf_counter() - t0)

    return run


def _boundary_storage(policy: CheckpointPolicy, x: torch.Tensor) -> contextlib.AbstractContextManager:
    # checkpoint saves its inputs through the saved-tensor hooks active around the call
    # (its own hooks take over inside), so save_on_cpu here moves only the group inputs
    if not policy.cpu_checkpointing:
        return contextlib.nullcontext()
    if not x.is_cuda:
        _log_once("activation_checkpointing.cpu_checkpointing: the activations are already in CPU memory; "
                  "no effect on a CPU device")
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(_pack_to_host, _unpack_from_host)


def _pack_to_host(t: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
    """A saved tensor's copy in pinned host memory. The device-to-host copy is queued
    without waiting: nothing reads the host copy before the host-to-device copy back,
    which the same stream orders after it (the pinned block is kept by torch's host
    allocator until that copy is done)."""
    if not t.is_cuda:
        return t.device, t
    host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return t.device, host


def _unpack_from_host(packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
    device, t = packed
    return t if t.device == device else t.to(device, non_blocking=True)


class Checkpointable:
    """Mixed into a zeal model (an ``nn.Module`` that sets ``self.checkpoint_policy`` in
    ``__init__`` and runs ``layer_stack()`` through :func:`run_blocks`). Gives the
    ``checkpoint_activations`` flag and Hugging Face's enable/disable methods."""

    checkpoint_policy: CheckpointPolicy

    def layer_stack(self) -> nn.ModuleList:
        """The blocks that checkpointing groups; each model that mixes this in returns its own."""
        raise TypeError(f"{type(self).__name__} mixes in Checkpointable but does not define layer_stack()")

    @property
    def checkpoint_activations(self) -> bool:
        """Whether a training forward checkpoints the layer stack."""
        return self.checkpoint_policy.enabled

    @checkpoint_activations.setter
    def checkpoint_activations(self, on: bool) -> None:
        self.checkpoint_policy.enabled = bool(on)

    @property
    def is_gradient_checkpointing(self) -> bool:
        """Hugging Face's name for :attr:`checkpoint_activations`."""
        return self.checkpoint_policy.enabled

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        """Turn checkpointing on, Hugging Face style; the only kwarg is ``use_reentrant``."""
        kwargs = dict(gradient_checkpointing_kwargs or {})
        use_reentrant = kwargs.pop("use_reentrant", False)
        if kwargs:
            raise ValueError(f"gradient_checkpointing_kwargs {sorted(kwargs)}: zeal's models take only use_reentrant")
        self.checkpoint_policy.use_reentrant = bool(use_reentrant)
        self.checkpoint_policy.enabled = True

    def gradient_checkpointing_disable(self) -> None:
        """Turn checkpointing off."""
        self.checkpoint_policy.enabled = False
