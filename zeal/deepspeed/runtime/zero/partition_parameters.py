"""``deepspeed.runtime.zero.partition_parameters``: the names scripts import from it.

zeal keeps ZeRO-3's per-parameter state in its own side table. For scripts written
against DeepSpeed, ``deepspeed.initialize`` at stage 3 gives the model's parameters
DeepSpeed's markers (``ds_id``, ``ds_numel``, ``ds_shape``, ``ds_status``; see
:func:`zeal.deepspeed.zero.mark_partitioned`), so their ``hasattr(p, "ds_id") and
p.ds_status == ZeroParamStatus.NOT_AVAILABLE`` test selects the parameters to gather with
:class:`GatheredParameters` (inside it they read AVAILABLE)."""

from __future__ import annotations

from enum import Enum

from zeal.deepspeed.zero import (
    GatheredParameters,
    Init,
    register_external_parameter,
    unregister_external_parameter,
)

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "ZeroParamType", "register_external_parameter",
           "unregister_external_parameter"]


class ZeroParamStatus(Enum):
    """Where a ZeRO-3 parameter's values are (DeepSpeed's enum)."""

    AVAILABLE = 1      # whole on every rank
    NOT_AVAILABLE = 2  # partitioned
    INFLIGHT = 3       # being gathered


class ZeroParamType(Enum):
    """How a ZeRO-3 parameter is held (DeepSpeed's enum)."""

    NORMAL = 1       # not partitioned
    PARTITIONED = 2  # partitioned, a placeholder in the module
    REMOTE = 3       # offloaded
