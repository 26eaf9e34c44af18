"""Adam/AdamW over flat fp32 tensors on the CPU, for offloaded master shards.

:class:`CPUAdam` holds only hyperparameters; the caller owns the tensors (master
parameters, gradients and :class:`AdamState` moments), so the disk tier can stream
them through reusable buffers. The default path performs the exact op sequence of
``torch.optim.Adam``/``AdamW``'s single-tensor implementation (the one torch uses for
CPU tensors by default), so results are bit-identical to it; torch's elementwise ops
use the intra-op thread pool (``torch.set_num_threads``). ``fused=True`` calls torch's
fused CPU kernel instead: one pass over memory, several times faster, equal to
``AdamW(fused=True)`` but not bitwise to the default path (rounding-level differences).

:class:`DelayedUpdate` implements the one-step delayed parameter update (DPU) of the
ZeRO-Offload paper (§5).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AdamState:
    """Moments of one flat parameter tensor and its step count (updates applied so far)."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int = 0

    @classmethod
    def zeros_like(cls, param: torch.Tensor) -> AdamState:
        return cls(torch.zeros_like(param), torch.zeros_like(param), 0)


class CPUAdam:
    """Adam (``adamw=False``: L2 penalty added to the gradient) or AdamW (decoupled
    decay) on caller-supplied tensors. Parameters and states are updated in place;
    gradients are only read. ``lr`` may be changed between steps (schedules)."""

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adamw: bool = True, fused: bool = False) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"lr, eps and weight_decay must be >= 0 (got {lr}, {eps}, {weight_decay})")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must lie in [0, 1), got {betas}")
        self.lr = lr
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = eps
        self.weight_decay = weight_decay
        self.adamw = adamw
        self.fused = fused

    def update(self, param: torch.Tensor, grad: torch.Tensor, state: AdamState, lr: float | None = None) -> None:
        """Apply one Adam step to ``param`` (and ``state``) from ``grad``; ``state.step`` += 1."""
        lr = self.lr if lr is None else lr
        state.step += 1
        if self.fused:
            self._fused_update(param, grad, state, lr)
            return
        beta1, beta2 = self.betas
        wd = self.weight_decay
        # Same ops, same order as torch.optim.adam._single_tensor_adam.
        if wd != 0:
            if self.adamw:
                param.mul_(1 - lr * wd)
            else:
                grad = grad.add(param, alpha=wd)
        state.exp_avg.lerp_(grad, 1 - beta1)
        state.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step = float(state.step)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        denom = (state.exp_avg_sq.sqrt() / bias_correction2**0.5).add_(self.eps)
        param.addcdiv_(state.exp_avg, denom, value=-step_size)

    def _fused_update(self, param: torch.Tensor, grad: torch.Tensor, state: AdamState, lr: float) -> None:
        kernel = torch._fused_adamw_ if self.adamw else torch._fused_adam_
        kernel([param], [grad], [state.exp_avg], [state.exp_avg_sq], [],
               [torch.tensor(float(state.step))], lr=lr, beta1=self.betas[0], beta2=self.betas[1],
               weight_decay=self.weight_decay, eps=self.eps, amsgrad=False, maximize=False)

    def step(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
             states: Sequence[AdamState], lr: float | None = None) -> None:
        """:meth:`update` each (param, grad, state) triple."""
        if not len(params) == len(grads) == len(states):
            raise ValueError(f"{len(params)} params, {len(grads)} grads, {len(states)} states")
        for p, g, s in zip(params, grads, states):
            self.update(p, g, s, lr)

    def hyperparams(self) -> dict[str, Any]:
        return {"lr": self.lr, "betas": list(self.betas), "eps": self.eps,
                "weight_decay": self.weight_decay, "adamw": self.adamw}

    def state_dict(self, states: Sequence[AdamState]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """``(tensors, meta)``: tensors ``exp_avg.{i}``/``exp_avg_sq.{i}`` (safetensors-ready)
        and JSON-able hyperparameters plus per-state step counts."""
        tensors: dict[str, torch.Tensor] = {}
        for i, s in enumerate(states):
            tensors[f"exp_avg.{i}"] = s.exp_avg
            tensors[f"exp_avg_sq.{i}"] = s.exp_avg_sq
        return tensors, {**self.hyperparams(), "steps": [s.step for s in states]}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> list[AdamState]:
        """Restore hyperparameters from ``meta`` and return the states (tensors not copied)."""
        self.lr, self.eps, self.weight_decay = meta["lr"], meta["eps"], meta["weight_decay"]
        self.betas = (float(meta["betas"][0]), float(meta["betas"][1]))
        self.adamw = bool(meta["adamw"])
        return [AdamState(tensors[f"exp_avg.{i}"], tensors[f"exp_avg_sq.{i}"], int(step))
                for i, step in enumerate(meta["steps"])]


class DelayedUpdate:
    """One-step delayed parameter update (ZeRO-Offload §5).

    Each training step hands over ``update`` (the optimizer step on the CPU masters,
    reading this step's gradients) and ``publish`` (copy the masters to the compute
    parameters). For the first ``warmup_steps`` steps both run at once, so training is
    synchronous. Afterwards ``update`` runs on a background thread while the caller
    computes the next forward/backward on the parameters published so far; the next
    :meth:`submit` (or :meth:`wait`) joins it and then publishes. So the gradient of
    step t+1 is evaluated on p_t while p_{t+1} = p_t - lr·U(grad(p_{t-1})) is computed:
    staleness exactly one. The caller must not overwrite the gradients ``update`` reads
    until the next ``submit`` returns (double-buffer them), and must call :meth:`wait`
    before reading final parameters or checkpointing.
    """

    def __init__(self, warmup_steps: int) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.warmup_steps = warmup_steps
        self.steps_submitted = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zeal-dpu")
        self._inflight: tuple[Future, Callable[[], None]] | None = None
        self._lock = threading.Lock()

    @property
    def delayed(self) -> bool:
        """Whether the next submitted step will run in the background."""
        return self.steps_submitted >= self.warmup_steps

    def submit(self, update: Callable[[], None], publish: Callable[[], None]) -> None:
        with self._lock:
            self._join()
            delayed = self.delayed
            self.steps_submitted += 1
            if not delayed:
                update()
                publish()
            else:
                self._inflight = (self._pool.submit(update), publish)

    def wait(self) -> None:
        """Finish the update in flight (re-raising its error) and publish its result."""
        with self._lock:
            self._join()

    def _join(self) -> None:
        if self._inflight is not None:
            future, publish = self._inflight
            self._inflight = None
            future.result()
            publish()

    def close(self) -> None:
        self.wait()
        self._pool.shutdown()
