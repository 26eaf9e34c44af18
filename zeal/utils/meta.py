"""Building modules on the meta device without running their random initialisers.

A module built under ``torch.device("meta")`` still runs its ``reset_parameters``; on a
meta tensor ``normal_`` goes through torch's Python reference, whose first call imports
``torch._dynamo`` (2-3 s of a process's start, measured on this project's 2-core CPU) to
fill a tensor that has no data. :func:`meta_device` skips those fills: a meta tensor holds no values, and whoever
materialises the module (ZeRO's per-unit initialiser, a checkpoint load) writes them later,
so the module built is the same. (Other ops on meta tensors can take the same path; model
code computes its constant tables, such as the rotary frequencies, on the CPU.)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# in-place random fills an initialiser calls (torch.nn.init and reset_parameters use these)
_RANDOM_FILLS = frozenset({"normal_", "uniform_", "random_", "exponential_", "geometric_", "cauchy_",
                           "log_normal_", "bernoulli_"})


class _SkipMetaFills(TorchFunctionMode):
    """Returns a meta tensor unchanged from an in-place random fill; everything else runs."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _RANDOM_FILLS:
            # Tensor.normal_(t, ...) passes the tensor first; torch.nn.init.normal_ by keyword
            t = args[0] if args else kwargs.get("tensor")
            if isinstance(t, torch.Tensor) and t.is_meta:
                return t
        return func(*args, **kwargs)


@contextmanager
def meta_device() -> Iterator[None]:
    """``with meta_device():`` — as ``with torch.device("meta"):``, without the random fills
    of the modules' initialisers (see the module's docstring)."""
    with torch.device("meta"), _SkipMetaFills():
        yield
