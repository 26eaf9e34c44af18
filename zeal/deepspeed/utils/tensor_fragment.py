"""``deepspeed.utils``' ``safe_get_full_*`` / ``safe_set_full_*`` and ``safe_*_local_*``:
one parameter's fp32 master, gradient or optimizer state, whole or this rank's part,
given the model's parameter object (``engine.module``'s), at any ZeRO stage.

They map onto :mod:`zeal.zero.param_access` (over zeal's sharded-state view). The
``full`` functions are collectives: every rank calls them with the same parameter.
``local`` values are this rank's owned part of the flattened parameter in zeal's
partition (flat units), so their length can differ from DeepSpeed's per-parameter
partition; ``full`` values are the same as DeepSpeed's. Gradients are readable after the
backward of an accumulation boundary and before ``step`` (as in DeepSpeed); writing
them is refused (zeal's gradients are written by backward)."""

from __future__ import annotations

from typing import Any

import torch

from zeal.deepspeed.refusals import Refused
from zeal.zero import param_access

__all__ = ["safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_optimizer_state", "safe_set_local_fp32_param",
           "safe_set_local_optimizer_state"]


def _locate(param: torch.Tensor) -> tuple[Any, str]:
    """The live zeal engine whose model holds ``param``, and the parameter's name there."""
    from zeal.deepspeed.zero import _owner

    engine = _owner([param])
    if engine is None:
        raise ValueError("this parameter belongs to no model given to deepspeed.initialize")
    name = next(n for n, q in engine.module.named_parameters() if q is param)
    return engine, name


def _out(engine: Any, t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(engine.device)


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The whole fp32 master of ``param`` (None when it is frozen); every rank calls it."""
    engine, name = _locate(param)
    return _out(engine, param_access.full_state(engine, name, "fp32"))


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set ``param``'s fp32 master (and the model's copy) to ``value``; every rank calls it
    with the same value."""
    engine, name = _locate(param)
    param_access.set_full_state(engine, name, value.detach().float().cpu(), "fp32")


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """The whole optimizer state ``optim_state_key`` (``"exp_avg"``, ``"exp_avg_sq"``) of
    ``param``; None before the first step or for a frozen parameter. Every rank calls it."""
    engine, name = _locate(param)
    return _out(engine, param_access.full_state(engine, name, optim_state_key))


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set ``param``'s whole optimizer state ``optim_state_key``; every rank calls it."""
    engine, name = _locate(param)
    param_access.set_full_state(engine, name, value.detach().float().cpu(), optim_state_key)


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The whole fp32 mean gradient of ``param`` after the boundary's backward (before
    ``step``), the fp16 loss scale taken out; every rank calls it."""
    engine, name = _locate(param)
    return _out(engine, param_access.full_state(engine, name, "grad"))


def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of ``param``'s fp32 master (1-d, zeal's flat partition)."""
    engine, name = _locate(param)
    return _out(engine, param_access.local_state(engine, name, "fp32"))


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of ``param``'s mean gradient (see :func:`safe_get_full_grad`)."""
    engine, name = _locate(param)
    return _out(engine, param_access.local_state(engine, name, "grad"))


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """This rank's part of ``param``'s optimizer state ``optim_state_key``."""
    engine, name = _locate(param)
    return _out(engine, param_access.local_state(engine, name, optim_state_key))


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set this rank's part of ``param``'s fp32 master (what :func:`safe_get_local_fp32_param`
    returns, same length); every rank calls it."""
    engine, name = _locate(param)
    param_access.set_local_state(engine, name, value.detach().float().cpu(), "fp32")


def safe_set_local_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set this rank's part of ``param``'s optimizer state ``optim_state_key``."""
    engine, name = _locate(param)
    param_access.set_local_state(engine, name, value.detach().float().cpu(), optim_state_key)


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Refused: zeal's gradients are written by backward."""
    raise Refused("deepspeed.utils.safe_set_full_grad", "zeal's gradients are written by backward: scale the "
                  "loss, or change the values after the step with safe_set_full_fp32_param")


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Refused: zeal's gradients are written by backward."""
    raise Refused("deepspeed.utils.safe_set_local_grad", "zeal's gradients are written by backward: scale the "
                  "loss, or change the values after the step with safe_set_local_fp32_param")
