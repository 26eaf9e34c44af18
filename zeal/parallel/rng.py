"""The random-number tracker of tensor parallelism (Megatron's ``get_cuda_rng_tracker``,
on CPU and CUDA).

Two streams per rank:

* the *default* generator (``torch.manual_seed``'s), identical on every rank of a tp
  group (:func:`zeal.parallel.tensor.apply_tensor_parallel` starts them all from tp rank
  0's state). Random ops on *replicated* activations draw from it — the embedding
  dropout, GPT-2's residual dropout after a row-parallel output — so their masks agree
  over the group, as they must for the replicas to stay equal;
* the tracker's ``"model-parallel-rng"`` state, seeded ``seed + 100·pp_rank + 2718 +
  tp_rank`` (Megatron's offsets: each pipeline stage its own streams): random
  ops inside a *split region* — between a split pair's input and its row-parallel output:
  attention dropout on this rank's heads, dropout on the column-parallel MLP hidden —
  run under :meth:`RNGTracker.fork`, so each rank's slice gets its own mask (with one
  generator the heads of every rank would share theirs).

:func:`apply_rng_regions` makes every split pair of a tensor-parallel model such a
region (a forward pre-hook on the pair's module enters the fork; one on its row linear
leaves it, before the all-reduce). Activation checkpointing restores the default stream
for the recompute itself (``torch.utils.checkpoint``'s ``preserve_rng_state``); the
tracker's streams are restored by :meth:`RNGTracker.replayable` (zeal's models) or
:func:`checkpoint_context` (``context_fn`` of a non-reentrant checkpoint, Hugging Face's
layers), so recomputed masks equal the forward's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["MODEL_PARALLEL_RNG", "RNGTracker", "apply_rng_regions", "checkpoint_context", "get_rng_tracker",
           "model_parallel_seed"]

MODEL_PARALLEL_RNG = "model-parallel-rng"
SEED_OFFSET = 2718  # the model-parallel stream's offset from the seed (Megatron's)
PP_SEED_STRIDE = 100  # added to the seed per pipeline stage (Megatron's)

_State = tuple[torch.Tensor, "torch.Tensor | None"]  # (CPU state, CUDA state of the current device)


def _cuda() -> bool:
    return torch.cuda.is_available()


def _current() -> _State:
    return torch.get_rng_state(), (torch.cuda.get_rng_state() if _cuda() else None)


def _install(state: _State) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


def _seeded(seed: int) -> _State:
    cpu = torch.Generator().manual_seed(seed).get_state()
    cuda = torch.Generator(device="cuda").manual_seed(seed).get_state() if _cuda() else None
    return cpu, cuda


class RNGTracker:
    """Named generator states beside the default one. ``fork(name)`` runs its block with
    ``name``'s state as the default generator (CPU and the current CUDA device) and keeps
    where the block left it; the default state is restored after."""

    def __init__(self) -> None:
        self.states: dict[str, _State] = {}
        self._saved: list[tuple[_State, str]] = []  # (default state, stream) of the forks now entered

    def reset(self) -> None:
        """Forget every named state."""
        self.states.clear()
        self._saved.clear()

    def add(self, name: str, seed: int) -> None:
        """A new stream ``name`` seeded with ``seed`` (the default generator is untouched)."""
        if name in self.states:
            raise ValueError(f"RNG tracker: state {name!r} already exists")
        self.states[name] = _seeded(seed)

    def get_states(self) -> dict[str, _State]:
        """A copy of every named state."""
        return {k: (c.clone(), g.clone() if g is not None else None) for k, (c, g) in self.states.items()}

    def set_states(self, states: dict[str, _State]) -> None:
        """Replace the named states (as :meth:`get_states` returned them)."""
        self.states = dict(states)

    def enter(self, name: str = MODEL_PARALLEL_RNG) -> None:
        """Make ``name``'s state the default generator's until :meth:`leave`."""
        if name not in self.states:
            raise KeyError(f"RNG tracker: no state {name!r} (seed it with model_parallel_seed)")
        self._saved.append((_current(), name))
        _install(self.states[name])

    def leave(self) -> None:
        """Store the forked stream where it is and restore the default generator."""
        saved, name = self._saved.pop()
        self.states[name] = _current()
        _install(saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block on stream ``name`` (Megatron's ``tracker.fork()``)."""
        self.enter(name)
        try:
            yield
        finally:
            self.leave()

    def replayable(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` for ``torch.utils.checkpoint``: its first call (the forward) records the
        named states, a later call (the recompute) runs from them and puts back the
        states of that moment after."""
        if not self.states:
            return fn
        start: list[dict[str, _State]] = []

        def run(*args: Any, **kwargs: Any) -> Any:
            if not start:
                start.append(self.get_states())
                return fn(*args, **kwargs)
            now = self.get_states()
            self.set_states({k: (c.clone(), g.clone() if g is not None else None) for k, (c, g) in start[0].items()})
            try:
                return fn(*args, **kwargs)
            finally:
                self.set_states(now)

        return run


_TRACKER = RNGTracker()


def get_rng_tracker() -> RNGTracker:
    """The process's tracker (Megatron's ``get_cuda_rng_tracker``; CPU and CUDA)."""
    return _TRACKER


def model_parallel_seed(seed: int, tp_rank: int, tracker: RNGTracker | None = None, pp_rank: int = 0) -> None:
    """(Re)seed the tracker's model-parallel stream with ``seed + 100·pp_rank + 2718 +
    tp_rank`` (so the stages of a pipeline draw apart); the default generator is left
    alone (equal over the tp group)."""
    tracker = tracker or _TRACKER
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, seed + PP_SEED_STRIDE * pp_rank + SEED_OFFSET + tp_rank)


def checkpoint_context(tracker: RNGTracker | None = None) -> tuple[Any, Any]:
    """``context_fn`` for a non-reentrant ``torch.utils.checkpoint``: the forward's context
    records the tracker's states, the recompute's runs from them (and restores after)."""
    tracker = tracker or _TRACKER
    start: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def forward() -> Iterator[None]:
        start.append(tracker.get_states())
        yield

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        now = tracker.get_states()
        if start:
            tracker.set_states(start[0])
        try:
            yield
        finally:
            tracker.set_states(now)

    return forward(), recompute()


# -- split regions ---------------------------------------------------------------------------
class _Region:
    """One split pair: entered at the pair's module, left at its row linear (or at the
    module's end, if the row was not reached)."""

    def __init__(self, tracker: RNGTracker) -> None:
        self.tracker, self.inside = tracker, False

    def enter(self, *_: Any) -> None:
        if not self.inside:
            self.tracker.enter()
            self.inside = True

    def leave(self, *_: Any) -> None:
        if self.inside:
            self.inside = False
            self.tracker.leave()


def apply_rng_regions(model: nn.Module, tp: Any, seed: int, tracker: RNGTracker | None = None,
                      pp_rank: int = 0) -> int:
    """Seed the tracker for ``tp``'s rank and pipeline stage ``pp_rank``
    (:func:`model_parallel_seed`), make each split pair of ``model`` (``tp.modules``) a
    model-parallel RNG region, and have a zeal model's activation checkpointing replay the
    tracker's streams (its ``checkpoint_policy.recompute``). Returns the number of regions."""
    from zeal.parallel.tensor import _attention_pair, _mlp_pair

    tracker = tracker or _TRACKER
    model_parallel_seed(seed, tp.rank, tracker, pp_rank=pp_rank)
    policy = getattr(model, "checkpoint_policy", None)
    if policy is not None and tracker.replayable not in policy.recompute:
        policy.recompute = (*policy.recompute, tracker.replayable)  # recomputed masks equal the forward's
    n = 0
    for name in tp.modules:
        mod = model.get_submodule(name)
        pair = _attention_pair(name, mod) or _mlp_pair(name, mod)
        if pair is None:
            continue
        region = _Region(tracker)
        mod.register_forward_pre_hook(region.enter)
        pair.row.register_forward_pre_hook(region.leave)
        mod.register_forward_hook(region.leave)
        n += 1
    return n
