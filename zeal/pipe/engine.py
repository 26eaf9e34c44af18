"""``PipelineEngine``: one optimizer step = ``M`` micro-batches through the stages' schedule.

``engine.train_batch(data_iter)`` draws ``M`` micro-batches (the first stage uses
their inputs, the last their labels; middle stages draw nothing), walks this stage's
step list (:mod:`zeal.pipe.schedule`), receiving and sending activations forward and
their gradients backward through ``mesh.pp`` (point-to-point, accounted under "pp"),
then runs the ZeRO optimizer step of this stage's parameters over ``mesh.dp``. The
gradient norm and the fp16 overflow flag are summed over the stages too, so clipping
sees the whole model. Returns the mean loss over the micro-batches and the
data-parallel ranks, on every rank.

With the interleaved schedule a stage holds several model chunks (virtual stages):
the passes name their chunk, activations of the last stage's chunks go on to the first
stage's next chunk (the ring wraps), and gradients come back the same way.

Each backward is framed by the engine's step hooks (``before_backward(boundary)`` with
the boundary on this stage's last backward of the step, then ``after_backward``), so
ZeRO's gradient reduction works as under gradient accumulation.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from zeal.pipe.schedule import schedule
from zeal.pipe.stages import Stage, split_batch
from zeal.train.engine import EngineParts, TrainEngine
from zeal.train.hooks import run_hooks
from zeal.utils.timers import make_clock

TAG_ACT, TAG_GRAD, TAG_TIED, TAG_HEAD = 1, 2, 3, 4
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32)
_HEADER = 9  # dtype code, ndim, up to 7 sizes


class PipelineEngine(TrainEngine):
    """A :class:`TrainEngine` for one pipeline stage; train with :meth:`train_batch`."""

    def __init__(self, parts: EngineParts, stage: Stage, schedule_name: str) -> None:
        super().__init__(parts)
        self.stage = stage
        self.schedule_name = schedule_name
        self.pp = parts.mesh.pp
        self._phases = make_clock(self.device)  # "bubble"/"busy" of the last train_batch (CUDA events on CUDA)
        self.peak_in_flight = 0  # most micro-batches whose activations this stage held at once
        parts.zero_optimizer.across = self.pp  # the norm and the overflow flag cover every stage
        self._iter: Iterator | None = None
        self._install_tied()
        self.global_params, self.global_state_dict_keys = self._layout()

    def _layout(self) -> tuple[dict, dict]:
        """The whole model's parameters and state-dict keys (for checkpoints)."""
        from zeal.pipe.layout import gather_layout, stage_layout
        from zeal.zero import sharded_state as zss

        tied = self.stage.tied
        names = {id(q): n for n, q in self.module.named_parameters()}
        alias = tied_name = None
        if tied is not None and tied.param is not None:
            tied_name = names[id(tied.param)]
        if tied is not None and tied.owner is not None and not self.stage.first:
            prefix = next(n for n, m in self.module.named_modules() if m is tied.owner)
            alias = f"{prefix}.{tied.attr}" if prefix else tied.attr
        with zss.sharded_state(self, local=True) as st:
            mine = stage_layout(st.params, self.module, alias, tied_name)
        return gather_layout(self.pp, mine)

    # -- what the plain engine offers and a stage cannot ----------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a pipeline engine runs whole steps: call engine.train_batch(data_iter) "
                           "(or eval_batch) instead of engine(batch) / backward / step")

    def is_first_stage(self) -> bool:
        return self.stage.first

    def is_last_stage(self) -> bool:
        return self.stage.last

    # -- one optimizer step -------------------------------------------------------------
    def train_batch(self, data_iter: Iterable | None = None) -> torch.Tensor:
        """Run one optimizer step over ``gradient_accumulation_steps`` micro-batches drawn
        from ``data_iter`` (default: the engine's data loader); returns the mean loss."""
        p = self._p
        m_count = p.grad_accum
        batches = self._draw(data_iter, m_count)
        self.module.train()
        steps = schedule(self.schedule_name, self.stage.index, self.stage.count, m_count, self.stage.chunks)
        scale = (p.scaler.scale if p.scaler else 1.0) / m_count
        inputs: dict[tuple[int, int], torch.Tensor] = {}
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        losses: list[torch.Tensor] = []
        sends: list = []
        backwards, total = 0, m_count * self.stage.chunks
        self._phases = make_clock(self.device)
        self.peak_in_flight = 0
        for kind, m, c in steps:
            if kind == "F":
                x, out = self._forward(m, c, batches)
                inputs[m, c] = x
                if self.stage.ends(c):
                    losses.append(out.detach())
                else:
                    sends += self._send_activation(out.detach())
                outputs[m, c] = out
                self.peak_in_flight = max(self.peak_in_flight, len(outputs))
                continue
            boundary = backwards == total - 1
            x, out = inputs.pop((m, c)), outputs.pop((m, c))
            roots, grads = self._backward_roots(out, c, scale, boundary)
            t0 = self._phases.mark()
            run_hooks(self._hooks, "before_backward", boundary)
            torch.autograd.backward(roots, grads)
            run_hooks(self._hooks, "after_backward")
            self._phases.add("busy", t0)
            backwards += 1
            if not self.stage.starts(c):
                sends.append(self.pp.isend(x.grad, self._prev, "grad", TAG_GRAD))
            if boundary and self.stage.last and self.stage.tied is not None and not self.stage.first:
                sends.append(self._send_tied_grad())
        for w in sends:
            w.wait()
        self._optimizer_step(m_count)
        return self._mean_loss(losses)

    @torch.no_grad()
    def eval_batch(self, data_iter: Iterable | None = None) -> torch.Tensor:
        """The mean loss of ``gradient_accumulation_steps`` micro-batches, forward only
        (the schedule's forwards, in its order)."""
        m_count = self._p.grad_accum
        batches = self._draw(data_iter, m_count)
        was = self.module.training
        self.module.eval()
        losses, sends = [], []
        steps = schedule(self.schedule_name, self.stage.index, self.stage.count, m_count, self.stage.chunks)
        for _, m, c in (s for s in steps if s.kind == "F"):
            _, out = self._forward(m, c, batches)
            if self.stage.ends(c):
                losses.append(out)
            else:
                sends += self._send_activation(out)
        for w in sends:
            w.wait()
        self.module.train(was)
        return self._mean_loss(losses)

    @property
    def _next(self) -> int:
        """The stage after this one (the last stage's next is the first: virtual stages wrap)."""
        return (self.stage.index + 1) % self.stage.count

    @property
    def _prev(self) -> int:
        return (self.stage.index - 1) % self.stage.count

    # -- pieces ------------------------------------------------------------------------------
    def _draw(self, data_iter: Iterable | None, count: int) -> list:
        if not (self.stage.first or self.stage.last):
            return [None] * count
        if data_iter is None:
            if self.dataloader is None:
                raise ValueError("train_batch needs a data iterator (or training_data given to initialize)")
            if self._iter is None:
                self._iter = iter(_repeat(self.dataloader))
            data_iter = self._iter
        it = iter(data_iter)
        return [split_batch(next(it)) for _ in range(count)]

    def _forward(self, m: int, c: int, batches: list) -> tuple[torch.Tensor, torch.Tensor]:
        if self.stage.starts(c):
            x = self._to_device(batches[m][0])
        else:
            x = self._recv_activation()
            if torch.is_grad_enabled() and x.is_floating_point():
                x.requires_grad_(True)
        t0 = self._phases.mark()
        # The stage runs on a copy of a received activation (as DeepSpeed's): x stays the leaf
        # whose .grad goes back, and a first layer may work in place (nn.ReLU(inplace=True)).
        out = self.stage.forwards[c](x.clone() if x.requires_grad else x)
        if self.stage.ends(c):
            out = self.stage.loss(out, self._to_device(batches[m][1]))
        self._phases.add("busy", t0)
        return x, out

    def _backward_roots(self, out: torch.Tensor, c: int, scale: float, boundary: bool) -> tuple[list, list]:
        if self.stage.ends(c):
            return [out.float()], [torch.full((), scale, device=out.device)]
        g = torch.empty_like(out)
        self._wait(self.pp.irecv(g, self._next, "grad", TAG_GRAD))
        roots, grads = [out], [g]
        tied = self.stage.tied
        if boundary and self.stage.first and tied is not None and not self.stage.last:
            tg = torch.empty_like(tied.param)
            self._wait(self.pp.irecv(tg, self.stage.count - 1, "grad", TAG_TIED))
            roots.append(tied.param)
            grads.append(tg)
        return roots, grads

    def _send_activation(self, out: torch.Tensor) -> list:
        if out.dim() > _HEADER - 2:
            raise ValueError(f"a pipeline activation has at most {_HEADER - 2} dimensions, got {out.dim()}")
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0], header[1] = _DTYPES.index(out.dtype), out.dim()
        header[2:2 + out.dim()] = torch.tensor(out.shape, dtype=torch.int64)
        dst = self._next
        out = out.contiguous()
        return [self.pp.isend(header.to(out.device), dst, "control", TAG_HEAD),
                self.pp.isend(out, dst, "param", TAG_ACT)]

    def _recv_activation(self) -> torch.Tensor:
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        src = self._prev
        self._wait(self.pp.irecv(header, src, "control", TAG_HEAD))
        code, ndim, *sizes = header.tolist()
        x = torch.empty(sizes[:ndim], dtype=_DTYPES[code], device=self.device)
        self._wait(self.pp.irecv(x, src, "param", TAG_ACT))
        return x

    def _wait(self, work: Any) -> None:
        t0 = self._phases.mark()
        work.wait()
        self._phases.add("bubble", t0)

    @property
    def bubble_time(self) -> float:
        """Seconds this stage waited for its peers in the last train_batch."""
        return self._phases.total("bubble")

    @property
    def busy_time(self) -> float:
        """Seconds it computed in the last train_batch."""
        return self._phases.total("busy")

    def _optimizer_step(self, m_count: int) -> None:
        p = self._p
        self.micro_steps += m_count
        self.global_samples += p.micro_batch * m_count * self.mesh.dp_size
        t0 = self._mark()
        applied = p.zero_optimizer.step()
        run_hooks(self._hooks, "after_step", applied)
        if applied and self.lr_scheduler is not None:
            self.lr_scheduler.step()
        if applied:
            self._sync_tied()
        self.global_steps += 1
        self.mesh.stats.end_step()
        self._tick("step", t0)

    def _mean_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        t = torch.zeros(1, dtype=torch.float64, device=self.device)
        if self.stage.last:
            t[0] = torch.stack([x.double() for x in losses]).mean()
            t[0] = self.mesh.dp.all_reduce_scalar(float(t[0])) / self.mesh.dp_size
        self.pp.broadcast(t, self.stage.count - 1, "control")
        return t[0].float()

    # -- the tied embedding / head -----------------------------------------------------------
    def _install_tied(self) -> None:
        """Give the last stage its copy of the tied weight, with the first stage's values."""
        tied = self.stage.tied
        if tied is None:
            return
        if self.stage.last and not self.stage.first:
            copy = torch.empty(tied.shape, dtype=self._p.compute_dtype, device=self.device)
            setattr(tied.owner, tied.attr, copy.requires_grad_(True))
        self._sync_tied()

    @torch.no_grad()
    def _sync_tied(self) -> None:
        """The first stage's (updated) tied weight → the last stage's copy."""
        tied, last = self.stage.tied, self.stage.count - 1
        if tied is None:
            return
        if self.stage.first:
            self.pp.send(tied.param.data.contiguous(), last, "param", TAG_TIED)
        elif self.stage.last:
            self.pp.recv(tied.copy.data, 0, "param", TAG_TIED)

    def _send_tied_grad(self) -> Any:
        copy = self.stage.tied.copy
        grad, copy.grad = copy.grad, None
        return self.pp.isend(grad.contiguous(), 0, "grad", TAG_TIED)

    def load_sharded_state(self, *args: Any, **kwargs: Any) -> None:
        super().load_sharded_state(*args, **kwargs)
        self._sync_tied()


def _repeat(loader: Iterable) -> Iterator:
    while True:
        yield from loader
