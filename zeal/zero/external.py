"""Parameters a module uses in its forward without registering them (ZeRO-3).

Stage 3 gathers a module's own parameters around its forward. A parameter read by
another module's forward (a tied head written as ``x @ self.emb.weight.t()`` in the
parent) is *external* to the module that reads it. zeal detects such reads during
the forward and gathers them on the spot (see :class:`ExternalReads`); this side
table lets a user declare them up front instead, as DeepSpeed's
``register_external_parameter`` does, so that they are gathered with the module from
the first step on. No attribute is set on the module or the parameter.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

_EXTERNAL: weakref.WeakKeyDictionary[nn.Module, list[nn.Parameter]] = weakref.WeakKeyDictionary()


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Declare that ``module``'s forward reads ``parameter``, which another module owns:
    under ZeRO-3 it is then gathered with ``module`` (forward and backward). zeal also
    finds such reads by itself during the forward; declaring them is never wrong."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"register_external_parameter: module must be an nn.Module, got {type(module).__name__}")
    if not isinstance(parameter, nn.Parameter):
        raise TypeError("register_external_parameter: parameter must be an nn.Parameter, "
                        f"got {type(parameter).__name__}")
    params = _EXTERNAL.setdefault(module, [])
    if not any(p is parameter for p in params):
        params.append(parameter)


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undo :func:`register_external_parameter` (a no-op when it was not registered)."""
    params = _EXTERNAL.get(module, [])
    params[:] = [p for p in params if p is not parameter]


def external_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters declared external to ``module``."""
    return list(_EXTERNAL.get(module, ()))


# Reads of a tensor's metadata only: a released parameter keeps its shape, dtype and device.
_METADATA = frozenset(
    getattr(torch.Tensor, name) for name in (
        "size", "dim", "numel", "nelement", "stride", "element_size", "is_floating_point", "is_complex",
        "storage_offset", "is_contiguous", "type", "get_device", "__len__", "__hash__", "__repr__", "__format__",
        "register_hook", "register_post_accumulate_grad_hook",
    ) if hasattr(torch.Tensor, name)
)


class ExternalReads(TorchFunctionMode):
    """Active while a ZeRO-3 model's forward runs: every torch function that receives a
    partitioned parameter calls ``on_read(param)`` first, which gathers the parameter's
    unit when no running module holds it. ``params``: the ids of the partitioned
    parameters (any container with ``in``). Attribute and metadata reads pass through."""

    def __init__(self, params: Collection[int], on_read: Callable[[nn.Parameter], None]) -> None:
        super().__init__()
        self._params, self._on_read = params, on_read

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _reads_data(func):
            for a in args:
                if isinstance(a, nn.Parameter) and id(a) in self._params:
                    self._on_read(a)
                elif isinstance(a, (list, tuple)):
                    for b in a:
                        if isinstance(b, nn.Parameter) and id(b) in self._params:
                            self._on_read(b)
            for a in kwargs.values():
                if isinstance(a, nn.Parameter) and id(a) in self._params:
                    self._on_read(a)
        return func(*args, **kwargs)


# attribute getters that hand out the data (``p.data``, ``p.T``, ...); all others are metadata
_DATA_GETTERS = tuple(d for d in (getattr(torch._C.TensorBase, "__dict__", {}).get(n) for n in ("data", "T", "mT", "H", "mH"))
                      if d is not None)


def _reads_data(func) -> bool:
    if getattr(func, "__name__", "") == "__get__":
        return getattr(func, "__self__", None) in _DATA_GETTERS
    return func not in _METADATA
