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
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from zeal.utils.timers import make_clock
from zeal.zero.external import ExternalReads, external_parameters
from zeal.zero.units import FlatUnit
from zeal.zero.zeropp import UnitCollectives

log = logging.getLogger("zeal")


@dataclass(eq=False)
class _Call:
    """One forward invocation of a hooked module: the units it holds (its own, plus
    external ones found while it ran) and how far its backward has come."""

    module: nn.Module
    units: list[FlatUnit]
    asked: bool = False  # its backward gathered the units
    done: bool = False   # its backward finished


class ParamCoordinator:
    """Gathers, releases and prefetches stage-3 units around every module call.

    ``needs`` maps each hooked module to the units its forward reads; the root module
    is always hooked, so that a parameter read outside the module that owns it is seen
    (:class:`ExternalReads`), gathered at once, and from then on gathered with the
    module that read it. All ranks must run the same modules in the same order (as in
    any ZeRO-3): every gather is a collective."""

    def __init__(self, model: nn.Module, units: list[FlatUnit], needs: dict[nn.Module, list[FlatUnit]],
                 coll: UnitCollectives, persistence_threshold: int, prefetch_elems: int,
                 max_reuse_distance: int, max_live_elems: int) -> None:
        self.root = model
        self.units, self.coll = units, coll
        self.needs = {m: list(us) for m, us in needs.items()}
        self.needs.setdefault(model, [])
        self.prefetch_elems = prefetch_elems
        self.max_reuse = max_reuse_distance
        self.max_live = max_live_elems
        self._unit_of = {id(p): u for u in units for p in u.params}
        self._names = {id(p): n for u in units for n, p in zip(u.names, u.params)}
        self._inflight: dict[int, object] = {}
        self._holds: dict[int, int] = {u.index: 0 for u in units}  # forward calls in flight holding it
        self._ctx_holds: dict[int, int] = {u.index: 0 for u in units}  # gathered() blocks
        self._bwd_held: set[int] = set()
        self._bwd_users: dict[int, int] = {}  # unit -> modules still to run their backward with it
        self._calls: dict[nn.Module, list[_Call]] = {}  # per module: forward invocations in flight
        self._stack: list[_Call] = []  # forward invocations in flight, innermost last
        self._mode: ExternalReads | None = None
        self._trace: list[int] = []          # recorded unit order of the last complete step
        self._recording: list[int] = []
        self._trace_fwd_len = 0              # trace entries before backward began
        self._rec_fwd_len: int | None = None
        self._in_backward = False
        self._pos = 0
        self._valid = False
        self._keep_spans: dict[int, list[tuple[int, int]]] = {}  # unit -> (use, next use) to bridge
        self._clock = make_clock(units[0].device if units else "cpu")  # CUDA events: the stall of the compute stream
        self.external_found: list[tuple[str, str]] = []  # (module, parameter) found reading outside its owner
        self._hooks = []
        for u in units:
            if u.numel <= persistence_threshold:
                u.persistent = True
        for u in units:
            if u.persistent:
                self._gather_now(u)
            else:
                u.free_full()
        for mod in list(self.needs):
            self._hook(mod)
        self._hooks.append(model.register_state_dict_pre_hook(self._check_state_dict))
        for mod in model.modules():
            for p in external_parameters(mod):
                self.add_external(mod, p)

    def _hook(self, mod: nn.Module) -> None:
        self._hooks.append(mod.register_forward_pre_hook(self._pre_forward))
        # always_call: a forward cut short (an exception, or non-reentrant checkpointing stopping
        # its recomputation early) still lets go of what it held
        self._hooks.append(mod.register_forward_hook(self._post_forward, always_call=True))

    def add_external(self, mod: nn.Module, param: nn.Parameter) -> None:
        """Gather ``param``'s unit whenever ``mod`` runs (forward and backward)."""
        u = self._unit_of.get(id(param))
        if u is None:
            raise ValueError(f"register_external_parameter: module '{_module_name(self.root, mod)}' declares a "
                             f"parameter of shape {tuple(param.shape)} that is not one of the model's parameters")
        if mod not in self.needs:
            self.needs[mod] = []
            self._hook(mod)
        if u not in self.needs[mod]:
            self.needs[mod].append(u)

    def _check_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        """The tensors of a released unit have no storage: reading them would crash the
        process, so ``state_dict()`` outside a gathered block is an error that says so
        (``keep_vars=True`` hands out the parameters themselves, to list names and shapes)."""
        if keep_vars:
            return
        for u in self.units:
            if not u.gathered:
                raise RuntimeError(
                    f"state_dict() of a ZeRO-3 model while its parameters are partitioned ('{u.names[0]}' "
                    "is not gathered here): call engine.module_state_dict() on every rank, or call it "
                    "inside `with engine.gathered_parameters():`")

    @property
    def gather_time(self) -> float:
        """Seconds compute waited for ZeRO-3 all-gathers (on CUDA: the compute stream's stall)."""
        return self._clock.total("gather")

    # -- gathering ----------------------------------------------------------------------
    def _start_gather(self, u: FlatUnit) -> None:
        if u.gathered or u.index in self._inflight:
            return
        u.alloc_full()
        self._inflight[u.index] = self.coll.gather(u, backward=self._in_backward)

    def _wait(self, u: FlatUnit) -> None:
        work = self._inflight.pop(u.index, None)
        if work is not None:
            t0 = self._clock.mark()
            work.wait()
            self._clock.add("gather", t0)

    def _gather_now(self, u: FlatUnit) -> None:
        self._start_gather(u)
        self._wait(u)

    def _held(self, u: FlatUnit) -> bool:
        return u.persistent or self._holds[u.index] > 0 or self._ctx_holds[u.index] > 0 or u.index in self._bwd_held

    def _release(self, u: FlatUnit) -> None:
        if self._held(u):
            return
        if self._valid and any(q < self._pos <= p for q, p in self._keep_spans.get(u.index, ())):
            return
        self._wait(u)
        u.free_full()

    def _request(self, units: list[FlatUnit], record: bool = True) -> None:
        """Record, prefetch, then make sure ``units`` are gathered. Passes that are not
        training (``model.eval()``: evaluation, generation) leave the trace alone."""
        if record:
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
        call = _Call(mod, list(self.needs[mod]))
        self._request(call.units, record=self.root.training)
        for u in call.units:
            self._holds[u.index] += 1
        self._calls.setdefault(mod, []).append(call)
        self._stack.append(call)
        if self._mode is None:  # the outermost hooked call watches for external reads
            self._mode = ExternalReads(self._unit_of, self._on_external_read)
            self._mode.__enter__()
        if torch.is_grad_enabled() and not isinstance(mod, nn.Embedding):
            # the gradient of an input is complete only after this module's backward ran
            for t in _tensors(args):
                if t.requires_grad:
                    t.register_hook(lambda grad, call=call: self._post_backward(call))

    def _post_forward(self, mod: nn.Module, args, output):
        calls = self._calls.get(mod)
        if not calls:
            return output
        call = calls.pop()
        if self._stack and self._stack[-1] is call:
            self._stack.pop()
        else:
            self._stack = [c for c in self._stack if c is not call]
        if not self._stack:
            self._leave_mode()
        for u in call.units:
            self._holds[u.index] -= 1
        for u in call.units:
            self._release(u)
        if output is not None and torch.is_grad_enabled() and not isinstance(mod, nn.Embedding):
            # (see the module docstring)
            def pre_backward(grad: torch.Tensor) -> None:
                if call.asked:
                    return
                call.asked = True
                fresh = [u for u in call.units if u.index not in self._bwd_held]
                if fresh:
                    self._request(fresh, record=self.root.training)
                    self._bwd_held.update(u.index for u in fresh)
                for u in call.units:
                    self._bwd_users[u.index] = self._bwd_users.get(u.index, 0) + 1

            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(pre_backward)
        return output

    def _on_external_read(self, param: nn.Parameter) -> None:
        """A torch function got ``param`` while no running module holds its unit: gather it
        now (every rank runs the same forward, so every rank gathers here too) and gather
        it with the innermost running module from now on."""
        u = self._unit_of[id(param)]
        if self._held(u) or not self._stack:
            return
        call = self._stack[-1]
        if u not in self.needs[call.module]:
            self.needs[call.module].append(u)
            where = _module_name(self.root, call.module)
            self.external_found.append((where, self._names[id(param)]))
            log.info("ZeRO-3: parameter '%s' is read in the forward of '%s', which does not own it; it is "
                     "gathered with that module from now on (declare it with "
                     "zeal.zero.register_external_parameter(module, param) to say so up front)",
                     self._names[id(param)], where)
        if u not in call.units:
            call.units.append(u)
            self._holds[u.index] += 1
            self._request([u], record=self.root.training)

    def _post_backward(self, call: _Call) -> None:
        """The module of ``call`` finished its backward: units no other pending backward
        needs may go, before their gradients are even complete."""
        if not call.asked or call.done:
            return
        call.done = True
        for u in call.units:
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
        for idx in list(self._inflight):  # prefetched for a use that did not come: nothing in flight at the step
            self._wait(self.units[idx])
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
        self._stack.clear()
        for u in self.units:
            self._wait(u)
            self._holds[u.index] = 0  # no forward spans a step: the shards have changed under any copy
            if not u.persistent and self._ctx_holds[u.index] == 0:
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

    def gathered(self) -> contextlib.AbstractContextManager:
        """Every unit gathered (full parameters on every rank) inside the block."""
        return self._gathering(self.units)

    def holding(self, params: list[torch.Tensor]) -> contextlib.AbstractContextManager:
        """The units of ``params`` gathered once for the whole block, whatever module calls run
        inside it (a tiled loss calling its head tile by tile). Parameters of no unit are ignored."""
        return self._gathering(list({id(u): u for p in params if (u := self._unit_of.get(id(p))) is not None}.values()))

    @contextlib.contextmanager
    def _gathering(self, units: list) -> Iterator[None]:
        """``units`` gathered on entry (all started, then waited for) and released on exit."""
        for u in units:
            self._start_gather(u)
        for u in units:
            self._wait(u)
            self._ctx_holds[u.index] += 1
        try:
            yield
        finally:
            for u in units:
                self._ctx_holds[u.index] -= 1
                self._release(u)

    def gathered_one_by_one(self, only: set[str] | None = None) -> Iterator[list[tuple[str, nn.Parameter]]]:
        """The units' full ``(name, parameter)`` lists, one unit gathered at a time (the
        next one's gather overlapping the caller's use); each is released after use.
        ``only``: just the units holding one of these parameter names (the rest are not gathered)."""
        units = self.units if only is None else [u for u in self.units if not only.isdisjoint(u.names)]
        for i, u in enumerate(units):
            self._gather_now(u)
            if i + 1 < len(units):
                self._start_gather(units[i + 1])
            self._ctx_holds[u.index] += 1
            try:
                yield list(zip(u.names, u.params))
            finally:
                self._ctx_holds[u.index] -= 1
                self._release(u)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._leave_mode()

    def _leave_mode(self) -> None:
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)


def _module_name(root: nn.Module, mod: nn.Module) -> str:
    for name, m in root.named_modules():
        if m is mod:
            return name or type(root).__name__
    return type(mod).__name__


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
