"""Gradient reduction for every stage, overlapped with backward.

Modes (chosen by stage):
* ``all_reduce`` (stage 0): gradients accumulate locally into a persistent full
  buffer per unit; at the accumulation boundary each unit is all-reduced as soon
  as backward has produced all of its gradients. Non-boundary micro-steps
  communicate nothing. The first gradient of a parameter after :meth:`zero` is
  copied into its slot (no zero-fill, no read-add), and ``param.grad`` becomes a
  view of the slot, so later micro-steps accumulate into it in place; slots of
  parameters that got no gradient are zeroed just before their unit is reduced.
* ``scatter_at_boundary`` (stage 1): as above, but a reduce-scatter leaves each
  rank the summed slice it owns.
* ``scatter_every_step`` (stages 2, 3): no full gradient is kept. Each gradient is
  copied into a transient flat buffer as it is produced and ``param.grad`` dropped;
  a complete unit is reduce-scattered and added to this rank's shard accumulator.
  This runs on every micro-step (as DeepSpeed does), so volume is (GAS + 1)·Ψ.

Reductions are launched asynchronously from post-accumulate-grad hooks in the
order gradients complete, which is the same on every rank for the same graph.
A unit is launched once each of its parameters has had a gradient accumulated. A
parameter can be accumulated more than once in one backward (reentrant activation
checkpointing runs a backward per checkpointed region: a parameter shared by two
regions, or a module run twice, gets one accumulation per region); what arrives
after its unit was launched is a *late* gradient, collected apart and reduced at the
end of backward (a sum of reductions is the reduction of the sum).
``overlap_comm=False`` launches them all after backward in unit order instead,
which is safe when ranks may skip different parameters.
Results are sums; :meth:`reduced_grad` divides by the world size (mean).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zeal.dist.buffers import BufferPool
from zeal.dist.comm import Comm
from zeal.zero.units import FlatUnit

MODES = ("all_reduce", "scatter_at_boundary", "scatter_every_step")


class GradReducer:
    def __init__(self, units: list[FlatUnit], comm: Comm, mode: str, overlap: bool = True,
                 max_inflight_elems: int = 500_000_000,
                 on_grads_taken: Callable[[FlatUnit], None] | None = None,
                 scatter: Callable[[torch.Tensor, torch.Tensor], object] | None = None,
                 mean_over: int | None = None) -> None:
        assert mode in MODES, mode
        self.units = [u for u in units if u.trainable]
        self.units_by_index = {u.index: u for u in self.units}
        self.comm, self.mode, self.overlap = comm, mode, overlap
        self.max_inflight = max_inflight_elems
        self.on_grads_taken = on_grads_taken
        # how a complete flat gradient is reduce-scattered (ZeRO++ swaps in qgZ)
        self._scatter = scatter or (lambda out, flat: comm.reduce_scatter(out, flat, "grad", async_op=True))
        self.world = mean_over or comm.size  # reduced_grad divides by it (a CommGroup's mean_over)
        self.full_grads: dict[int, torch.Tensor] = {}
        self.acc: dict[int, torch.Tensor] = {}       # summed shard per unit (stage 1: at boundary; 2/3: accumulated)
        self._flat: dict[int, torch.Tensor] = {}     # transient flat grads (scatter_every_step)
        self._got: dict[int, set[int]] = {}          # which slots of a transient flat grad are filled
        self._pool = BufferPool()  # flat gradient and reduce-scatter output buffers
        self._pending: list[tuple[FlatUnit, object, torch.Tensor | None, torch.Tensor | None]] = []
        self._inflight = 0
        self._ready_count: dict[int, int] = {}
        self._launched: set[int] = set()
        self._boundary = True
        self._slot_of: dict[int, tuple[FlatUnit, int]] = {}
        self._filled: dict[int, set[int]] = {u.index: set() for u in self.units}  # slots written since zero
        self._late: dict[int, torch.Tensor] = {}     # stages 0-1: late gradients (see above), full size
        self._flat_acc = None
        if mode == "scatter_every_step":  # one flat buffer; each unit's accumulator is a view
            self._flat_acc = torch.zeros(sum(u.shard_numel for u in self.units),
                                         dtype=self.units[0].dtype if self.units else torch.float32,
                                         device=self.units[0].device if self.units else "cpu")
            off = 0
            for u in self.units:
                self.acc[u.index] = self._flat_acc[off:off + u.shard_numel]
                off += u.shard_numel
        for u in self.units:
            for i, p in enumerate(u.params):
                self._slot_of[id(p)] = (u, i)
            if mode != "scatter_every_step":
                self.full_grads[u.index] = torch.zeros(u.padded, dtype=u.dtype, device=u.device)
            for p in u.params:
                p.register_post_accumulate_grad_hook(self._on_grad)

    # -- per backward ---------------------------------------------------------------
    def begin_backward(self, boundary: bool) -> None:
        self._boundary = boundary
        self._ready_count = {u.index: 0 for u in self.units}
        self._launched = set()

    def _communicates(self) -> bool:
        return self.mode == "scatter_every_step" or self._boundary

    def _on_grad(self, p: torch.Tensor) -> None:
        u, i = self._slot_of[id(p)]
        if u.index in self._launched and self.mode != "scatter_every_step":
            late = self._late.get(u.index)
            if late is None:
                late = self._late[u.index] = torch.zeros(u.padded, dtype=u.dtype, device=u.device)
            slot = u.slots[i]
            late[slot.offset:slot.end].add_(p.grad.reshape(-1))
            p.grad = None
            return
        if self.mode != "scatter_every_step":
            slot = u.slots[i]
            view = self.full_grads[u.index][slot.offset:slot.end].view(slot.shape)
            g = p.grad
            if g.data_ptr() != view.data_ptr():  # a fresh gradient from autograd
                if i in self._filled[u.index]:
                    view.add_(g)
                else:
                    view.copy_(g)
                p.grad = view
            self._filled[u.index].add(i)
        else:
            g = p.grad
            p.grad = None
            flat = self._flat.get(u.index)
            if flat is None and len(u.slots) == 1 and u.padded == u.numel and g.is_contiguous() \
                    and g.dtype == u.dtype:
                # a lone unpadded parameter (an embedding): its gradient is the flat buffer
                self._flat[u.index] = g.view(-1)
                self._got[u.index] = {0}
            else:
                if flat is None:
                    flat = self._flat[u.index] = self._take(u.padded, u)
                    self._got[u.index] = set()
                slot = u.slots[i]
                if i in self._got[u.index]:  # a second accumulation in this backward (see above)
                    flat[slot.offset:slot.end].add_(g.reshape(-1))
                else:
                    flat[slot.offset:slot.end].copy_(g.reshape(-1))
                self._got[u.index].add(i)
        self._ready_count[u.index] += 1
        if (self.overlap and self._communicates() and self._ready_count[u.index] == len(u.params)):
            self._launch(u)

    def _launch(self, u: FlatUnit, again: bool = False) -> None:
        """Start reducing ``u``'s gradients; ``again``: its late gradients (stages 2-3)."""
        if u.index in self._launched and not again:
            return
        self._launched.add(u.index)
        if self.mode != "scatter_every_step":
            # a gradient accumulated from now on must not land in the buffer being reduced
            for q in u.params:
                q.grad = None
            full = self.full_grads[u.index]
            for i, slot in enumerate(u.slots):
                if i not in self._filled[u.index]:  # no gradient since zero: the slot holds old values
                    full[slot.offset:slot.end].zero_()
                    self._filled[u.index].add(i)
        if self.mode == "all_reduce":
            work = self.comm.all_reduce(self.full_grads[u.index], "grad", async_op=True)
            self._pending.append((u, work, None, None))
        elif self.mode == "scatter_at_boundary":
            out = torch.empty(u.shard_numel, dtype=u.dtype, device=u.device)
            work = self.comm.reduce_scatter(out, self.full_grads[u.index], "grad", async_op=True)
            self._pending.append((u, work, out, None))
        else:
            flat = self._flat.pop(u.index, None)
            if flat is None:  # no parameter of this unit received a gradient
                flat = self._take(u.padded, u).zero_()
            else:
                got = self._got.pop(u.index)
                for i, slot in enumerate(u.slots):
                    if i not in got:  # an unused parameter contributes zeros
                        flat[slot.offset:slot.end].zero_()
                flat[u.numel:].zero_()  # padding
            out = self._take(u.shard_numel, u)
            work = self._scatter(out, flat)
            self._pending.append((u, work, out, flat))
            if self.on_grads_taken is not None:  # stage 3: the gathered parameters may go
                self.on_grads_taken(u)
        self._inflight += u.padded
        if self._inflight > self.max_inflight:
            self._drain(keep=1)

    def _drain(self, keep: int = 0) -> None:
        while len(self._pending) > keep:
            u, work, out, flat = self._pending.pop(0)
            work.wait()
            self._inflight -= u.padded
            if self.mode == "scatter_at_boundary":
                self.acc[u.index] = out
            elif self.mode == "scatter_every_step":
                self.acc[u.index].add_(out)
                self._give(flat)
                self._give(out)

    def _take(self, numel: int, u: FlatUnit) -> torch.Tensor:
        return self._pool.take(numel, u.dtype, u.device)

    def _give(self, t: torch.Tensor) -> None:
        if t._base is None:  # not a view of an autograd gradient
            self._pool.give(t)

    def wait_all(self) -> None:
        """Complete every reduction in flight, starting none."""
        self._drain()

    def finish_backward(self) -> None:
        """Launch what hooks did not (unused parameters, overlap off), then the late
        gradients, and wait for all."""
        if self._communicates():
            for u in self.units:
                self._launch(u)
            if self.mode == "scatter_every_step":
                for u in self.units:
                    if u.index in self._flat:  # late gradients: a second reduce-scatter adds them
                        self._launch(u, again=True)
        self._drain()
        for idx, late in self._late.items():
            u = self.units_by_index[idx]
            if self.mode == "all_reduce":
                self.comm.all_reduce(late, "grad")
                self.full_grads[idx].add_(late)
            else:
                out = torch.empty(u.shard_numel, dtype=u.dtype, device=u.device)
                self.comm.reduce_scatter(out, late, "grad")
                self.acc[idx].add_(out)
        self._late.clear()

    # -- for the optimizer ------------------------------------------------------------
    def reduced_grad(self, u: FlatUnit) -> torch.Tensor:
        """Mean gradient this rank updates: the full buffer (stage 0) or its shard."""
        g = self.full_grads[u.index] if self.mode == "all_reduce" else self.acc[u.index]
        if self.world > 1:
            g.div_(self.world)
        return g

    def flat_grads(self, units: list[FlatUnit], grads: list[torch.Tensor]) -> torch.Tensor:
        """The reduced shard gradients of ``units`` end to end (a view when they already are)."""
        if self._flat_acc is not None and [u.index for u in units] == [u.index for u in self.units]:
            return self._flat_acc
        return torch.cat([g.reshape(-1) for g in grads])

    def zero(self) -> None:
        for u in self.units:  # stages 0-1: the next gradient of each slot overwrites it
            self._filled[u.index].clear()
            if self.mode != "scatter_every_step":
                for p in u.params:
                    p.grad = None
        if self._flat_acc is not None:
            self._flat_acc.zero_()
        else:
            self.acc.clear()

    def buffer_nbytes(self) -> int:
        """Bytes of reusable flat buffers kept between steps (bounded by what was in flight)."""
        return self._pool.nbytes()

    def nbytes(self) -> int:
        """Persistent gradient bytes held by this rank."""
        full = sum(g.numel() * g.element_size() for g in self.full_grads.values())
        acc = self._flat_acc.numel() * self._flat_acc.element_size() if self._flat_acc is not None else 0
        return full + acc
