"""ZeRO-3 parameter lifecycle: gather just before use, release right after.

Forward: a module's pre-hook gathers the units holding the parameters it
registers (tied parameters included) and its post-hook releases them. Backward:
a hook on the module's outputs gathers them again before the module's backward
runs; they are released as soon as every module that asked for them in backward
is done with them (a hook on the module's input gradients says so), else once the
unit's gradients are reduced, else at the end of backward (frozen units). An
``nn.Embedding``'s backward reads only the indices, never the weight, so it asks
for nothing: a tied input embedding is not gathered again at the very end of
backward, and the output head that shares it lets it go right after its own
backward. Units at or below the persistence threshold stay gathered for the
whole run and are refreshed by an all-gather after each optimizer step.

The first step records the order in which units are requested (the trace). From
then on, requesting the unit at trace position i also launches asynchronous
gathers of the next units, up to ``prefetch_elems`` elements, and a unit is kept
instead of released when its next use in the trace is within
``max_reuse_distance`` elements. If execution departs from the trace, prefetch
stops for the rest of the step and the trace is recorded again (prefetch is
only a hint: every in-flight gather is waited for before its unit is used or
released).

Communication pattern per step, persistence 0 and reuse 0: forward all-gather Ψ,
backward all-gather Ψ, reduce-scatter Ψ (the latter in :mod:`grad_sync`): 3Ψ,
less the backward gather of embeddings that nothing else shares.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch
from torch import nn

from zeal.zero.units import FlatUnit
from zeal.zero.zeropp import UnitCollectives


class ParamCoordinator:
    def __init__(self, model: nn.Module, units: list[FlatUnit], needs: dict[nn.Module, list[FlatUnit]],
                 coll: UnitCollectives, persistence_threshold: int, prefetch_elems: int,
                 max_reuse_distance: int, max_live_elems: int) -> None:
        self.units, self.needs, self.coll = units, needs, coll
        self.prefetch_elems = prefetch_elems
        self.max_reuse = max_reuse_distance
        self.max_live = max_live_elems
        self._inflight: dict[int, object] = {}
        self._holds: dict[int, int] = {u.index: 0 for u in units}
        self._bwd_held: set[int] = set()
        self._bwd_users: dict[int, int] = {}  # unit -> modules still to run their backward with it
        self._calls: dict[nn.Module, list[dict]] = {}  # per module: forward invocations in flight
        self._trace: list[int] = []          # recorded unit order of the last complete step
        self._recording: list[int] = []
        self._trace_fwd_len = 0              # trace entries before backward began
        self._rec_fwd_len: int | None = None
        self._in_backward = False
        self._pos = 0
        self._valid = False
        self._keep_spans: dict[int, list[tuple[int, int]]] = {}  # unit -> (use, next use) to bridge
        self.gather_time = 0.0
        self._hooks = []
        for u in units:
            if u.numel <= persistence_threshold:
                u.persistent = True
        for u in units:
            if u.persistent:
                self._gather_now(u)
            else:
                u.free_full()
        for mod in needs:
            self._hooks.append(mod.register_forward_pre_hook(self._pre_forward))
            self._hooks.append(mod.register_forward_hook(self._post_forward))

    # -- gathering ----------------------------------------------------------------------
    def _start_gather(self, u: FlatUnit) -> None:
        if u.gathered or u.index in self._inflight:
            return
        u.alloc_full()
        self._inflight[u.index] = self.coll.gather(u, backward=self._in_backward)

    def _wait(self, u: FlatUnit) -> None:
        work = self._inflight.pop(u.index, None)
        if work is not None:
            t0 = time.perf_counter()
            work.wait()
            self.gather_time += time.perf_counter() - t0

    def _gather_now(self, u: FlatUnit) -> None:
        self._start_gather(u)
        self._wait(u)

    def _release(self, u: FlatUnit) -> None:
        if u.persistent or self._holds[u.index] > 0 or u.index in self._bwd_held:
            return
        if self._valid and any(q < self._pos <= p for q, p in self._keep_spans.get(u.index, ())):
            return
        self._wait(u)
        u.free_full()

    def _request(self, units: list[FlatUnit]) -> None:
        """Record, prefetch, then make sure ``units`` are gathered."""
        for u in units:
            if u.persistent:
                continue
            if self._valid:
                if self._pos < len(self._trace) and self._trace[self._pos] == u.index:
                    self._pos += 1
                else:
                    self._valid = False  # execution departed from the trace
            self._recording.append(u.index)
        if self._valid:
            self._prefetch()
        for u in units:
            self._start_gather(u)
        for u in units:
            self._wait(u)

    def _prefetch(self) -> None:
        budget = self.prefetch_elems
        live = sum(u.padded for u in self.units if u.gathered and not u.persistent)
        # forward prefetches forward uses only: backward gathers may take another route (hpZ)
        stop = len(self._trace) if self._in_backward else self._trace_fwd_len
        for idx in self._trace[self._pos:stop]:
            u = self.units[idx]
            if budget <= 0 or live >= self.max_live:
                break
            if not u.gathered:
                self._start_gather(u)
                budget -= u.padded
                live += u.padded

    # -- module hooks ---------------------------------------------------------------------
    def _pre_forward(self, mod: nn.Module, args) -> None:
        units = self.needs[mod]
        self._request(units)
        for u in units:
            self._holds[u.index] += 1
        call = {"asked": False, "done": False}
        self._calls.setdefault(mod, []).append(call)
        if torch.is_grad_enabled() and not isinstance(mod, nn.Embedding):
            # the gradient of an input is complete only after this module's backward ran
            for t in _tensors(args):
                if t.requires_grad:
                    t.register_hook(lambda grad, units=units, call=call: self._post_backward(units, call))

    def _post_forward(self, mod: nn.Module, args, output):
        units = self.needs[mod]
        call = self._calls[mod].pop()
        for u in units:
            self._holds[u.index] -= 1
        for u in units:
            self._release(u)
        if torch.is_grad_enabled() and not isinstance(mod, nn.Embedding):  # see the module docstring

            def pre_backward(grad: torch.Tensor) -> None:
                if call["asked"]:
                    return
                call["asked"] = True
                fresh = [u for u in units if u.index not in self._bwd_held]
                if fresh:
                    self._request(fresh)
                    self._bwd_held.update(u.index for u in fresh)
                for u in units:
                    self._bwd_users[u.index] = self._bwd_users.get(u.index, 0) + 1

            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(pre_backward)
        return output

    def _post_backward(self, units: list[FlatUnit], call: dict) -> None:
        """The module of ``call`` finished its backward: units no other pending backward
        needs may go, before their gradients are even complete."""
        if not call["asked"] or call["done"]:
            return
        call["done"] = True
        for u in units:
            if u.index not in self._bwd_users:  # its gradients were already taken
                continue
            left = self._bwd_users[u.index] = self._bwd_users[u.index] - 1
            if left == 0 and u.index in self._bwd_held:
                self._bwd_held.discard(u.index)
                self._release(u)

    # -- called by the gradient reducer and the engine ---------------------------------------
    def on_grads_taken(self, u: FlatUnit) -> None:
        """The unit's gradients are on their way: its gathered copy is no longer needed."""
        self._bwd_held.discard(u.index)
        self._bwd_users.pop(u.index, None)
        self._release(u)

    def begin_backward(self) -> None:
        self._in_backward = True
        if self._rec_fwd_len is None:
            self._rec_fwd_len = len(self._recording)

    def finish_backward(self) -> None:
        """Release what backward left gathered (frozen units, unused parameters)."""
        self._in_backward = False
        self._bwd_users.clear()
        for idx in list(self._bwd_held):
            self._bwd_held.discard(idx)
            self._release(self.units[idx])

    def end_step(self) -> None:
        """Close the trace of this step and release everything not persistent."""
        if self._recording:
            self._trace, self._recording = self._recording, []
            self._trace_fwd_len = self._rec_fwd_len if self._rec_fwd_len is not None else len(self._trace)
            self._compute_reuse()
        self._rec_fwd_len = None
        self.coll.drop_secondary()
        self._pos = 0
        self._valid = bool(self._trace)
        self._bwd_held.clear()
        self._bwd_users.clear()
        self._calls.clear()
        for u in self.units:
            self._wait(u)
            if not u.persistent and self._holds[u.index] == 0:
                u.free_full()

    def refresh_persistent(self, frozen_too: bool = False) -> None:
        """After shards changed (optimizer step; a checkpoint load with ``frozen_too``):
        bring persistent units up to date."""
        for u in self.units:
            if u.persistent and (u.trainable or frozen_too):
                self.coll.refresh(u)

    def _compute_reuse(self) -> None:
        """For each position p of the trace, keep unit trace[p] gathered until its next
        use when the elements requested in between are within max_reuse_distance. At
        0 that still keeps a unit used twice in a row, typically the output head at the
        turn from forward to backward: holding it over the loss costs nothing that the
        backward would not hold right after, and saves gathering it again."""
        self._keep_spans = {}
        last_seen: dict[int, int] = {}
        prefix = [0]
        for idx in self._trace:
            prefix.append(prefix[-1] + self.units[idx].padded)
        for p, idx in enumerate(self._trace):
            if idx in last_seen:
                q = last_seen[idx]
                if prefix[p] - prefix[q + 1] <= self.max_reuse:
                    self._keep_spans.setdefault(idx, []).append((q, p))
            last_seen[idx] = p

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every unit gathered (full parameters on every rank) inside the block."""
        for u in self.units:
            self._start_gather(u)
        for u in self.units:
            self._wait(u)
            self._holds[u.index] += 1
        try:
            yield
        finally:
            for u in self.units:
                self._holds[u.index] -= 1
                if not u.persistent and self._holds[u.index] == 0:
                    u.free_full()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _tensors(obj) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)
    elif hasattr(obj, "to_tuple"):  # Hugging Face ModelOutput
        yield from _tensors(obj.to_tuple())
