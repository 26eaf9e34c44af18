"""DeepSpeed's ``deepspeed.zero``: ``Init`` and ``GatheredParameters`` on zeal.

``Init`` builds the model on the meta device (no memory); ``zeal.initialize``
materialises each flat unit on its owning ranks only, so a stage-3 model never exists
whole on one rank. ``GatheredParameters`` gives full parameters inside its block and,
with ``modifier_rank``, makes that rank's changes everyone's (masters included)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from enum import Enum
from typing import Any

import torch

from zeal.utils.meta import meta_device


class ZeroParamStatus(Enum):
    """Where a ZeRO-3 parameter's values are (DeepSpeed's enum; also at DeepSpeed's path
    ``deepspeed.runtime.zero.partition_parameters``)."""

    AVAILABLE = 1      # whole on every rank
    NOT_AVAILABLE = 2  # partitioned
    INFLIGHT = 3       # being gathered


class ZeroParamType(Enum):
    """How a ZeRO-3 parameter is held (DeepSpeed's enum)."""

    NORMAL = 1       # not partitioned
    PARTITIONED = 2  # partitioned, a placeholder in the module
    REMOTE = 3       # offloaded


class Init:
    """``with zero.Init(): model = MyModel()`` — the model is built on the meta device and
    materialised by ``initialize`` (with the model's own initialiser). DeepSpeed's
    arguments are accepted; ``enabled=False`` builds normally.

    Given a DeepSpeed config (``config_dict_or_path=`` / ``config=``: how transformers'
    ``from_pretrained`` and DeepSpeed-Chat call it, to write the checkpoint's weights through
    :func:`GatheredParameters` next), the model is built whole on the CPU instead, so the
    loader has real tensors to write into; ``initialize`` partitions it as any built model
    (the whole model exists once per rank until then)."""

    def __init__(self, module: Any = None, data_parallel_group: Any = None, mem_efficient_linear: bool = True,
                 remote_device: str | None = None, pin_memory: bool = False, config_dict_or_path: Any = None,
                 config: Any = None, enabled: bool = True, dtype: torch.dtype | None = None, mpu: Any = None,
                 **kwargs: Any) -> None:
        if module is not None:
            raise ValueError("zero.Init(module=...) (partitioning a built module) is not supported; build the "
                             "model inside `with zero.Init():` or pass it to initialize as it is")
        self.enabled = enabled and config_dict_or_path is None and config is None
        self._device: Any = None

    def __enter__(self) -> Init:
        if self.enabled:
            self._device = meta_device()  # ZeRO materialises each unit with the model's own initialiser
            self._device.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._device is not None:
            self._device.__exit__(*exc)
            self._device = None


def _owner(params: list[torch.Tensor]) -> Any:
    """The live zeal engine whose model holds any of ``params`` (None: a plain model)."""
    from zeal.train.engine import live_engines

    ids = {id(p) for p in params}
    for engine in live_engines():
        if any(id(q) in ids for q in engine.module.parameters()):
            return engine
    return None


@contextlib.contextmanager
def GatheredParameters(params: torch.Tensor | Iterable[torch.Tensor], modifier_rank: int | None = None,
                       fwd_module: Any = None, enabled: bool = True) -> Iterator[None]:
    """Full values of ``params`` inside the block (every rank calls it). With
    ``modifier_rank``, what that rank wrote into them is broadcast on exit and becomes
    the parameters' value everywhere, fp32 masters included; without it, changes are
    discarded (as in DeepSpeed)."""
    del fwd_module
    params = [params] if isinstance(params, torch.Tensor) else [p for p in params if p is not None]
    if not enabled or not params:
        yield
        return
    engine = _owner(params)
    marked = [p for p in params if hasattr(p, "ds_status")]
    if engine is None:
        if any(p.is_meta for p in params):
            raise RuntimeError("GatheredParameters: these parameters are on the meta device (built under "
                               "zero.Init) until zeal.initialize materialises them; change them after initialize "
                               "(engine.module), or give initialize an init_fn")
        yield  # a plain model: the parameters are already whole
        _broadcast_plain(params, modifier_rank)
        return
    ids = {id(p) for p in params}
    full: dict[str, torch.Tensor] = {}
    with engine.gathered_parameters(), _available(marked):
        yield
        if modifier_rank is not None:
            world = engine.mesh.world
            for name, p in engine.module.named_parameters():
                if id(p) in ids:
                    t = p.data.detach().float().clone()
                    if world.active:
                        world.broadcast(t, modifier_rank, "control")
                    full[name] = t
    if modifier_rank is not None:
        from zeal.zero.sharded_state import set_full_values

        set_full_values(engine, full)


@contextlib.contextmanager
def _available(params: list[torch.Tensor]) -> Iterator[None]:
    """DeepSpeed's ``ds_status`` of marked parameters reads AVAILABLE inside the block."""
    for p in params:
        p.ds_status = ZeroParamStatus.AVAILABLE
    try:
        yield
    finally:
        for p in params:
            p.ds_status = ZeroParamStatus.NOT_AVAILABLE


def mark_partitioned(module: torch.nn.Module) -> None:
    """Give a ZeRO-3 model's parameters DeepSpeed's markers, which DeepSpeed scripts test
    before gathering (``hasattr(p, "ds_id") and p.ds_status == NOT_AVAILABLE``, as in
    DeepSpeed-Chat's saving and EMA code): ``ds_id``, ``ds_numel``, ``ds_shape`` and
    ``ds_status`` (NOT_AVAILABLE; AVAILABLE inside :func:`GatheredParameters`). Only the
    ``deepspeed`` facade sets them, for scripts written against DeepSpeed; zeal itself
    reads none of them (its ZeRO-3 state is in its own side table)."""
    for i, p in enumerate(module.parameters()):
        p.ds_id, p.ds_numel, p.ds_shape = i, p.numel(), p.shape
        p.ds_status = ZeroParamStatus.NOT_AVAILABLE


def _broadcast_plain(params: list[torch.Tensor], modifier_rank: int | None) -> None:
    import torch.distributed as dist

    if modifier_rank is None or not (dist.is_available() and dist.is_initialized()):
        return
    with torch.no_grad():
        for p in params:
            dist.broadcast(p.data, modifier_rank)


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Accepted for compatibility: zeal gathers parameters used outside their module by itself."""


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Accepted for compatibility (see :func:`register_external_parameter`)."""
