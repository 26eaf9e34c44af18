"""The step-hook protocol: what an applied feature does around backward and step.

Each apply-step (ZeRO, offload, and later token dropping, sparsity re-masking, EMA or
weight sync for RLHF) registers an object with the engine; ``backward()`` and
``step()`` walk the list in registration order, so the engine never names a feature.
A hook implements any subset of the methods below (a missing one is skipped).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class StepHook(Protocol):
    """Called by :class:`~zeal.train.engine.TrainEngine` on every rank, in the same order.

    * ``before_backward(boundary)``: before ``loss.backward()``; ``boundary`` says whether
      this micro-step ends an accumulation (the optimizer steps after it).
    * ``after_backward()``: after ``loss.backward()`` returned (gradients are complete).
    * ``after_step(applied)``: after the optimizer step at an accumulation boundary;
      ``applied`` is False when the step was skipped (fp16 overflow).
    * ``close()``: the engine is closed; release hooks and buffers."""

    def before_backward(self, boundary: bool) -> None: ...

    def after_backward(self) -> None: ...

    def after_step(self, applied: bool) -> None: ...

    def close(self) -> None: ...


HOOK_METHODS = ("before_backward", "after_backward", "after_step", "close")


def check_hook(hook: object) -> None:
    """Raise TypeError unless ``hook`` has at least one step-hook method."""
    if not any(callable(getattr(hook, m, None)) for m in HOOK_METHODS):
        raise TypeError(f"{type(hook).__name__} has none of the step-hook methods {', '.join(HOOK_METHODS)}")


def run_hooks(hooks: list[object], method: str, *args: object) -> None:
    """Call ``method(*args)`` on every hook that has it, in order."""
    for h in hooks:
        fn = getattr(h, method, None)
        if fn is not None:
            fn(*args)
