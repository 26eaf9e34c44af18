"""``deepspeed.runtime.zero.partition_parameters``: the names scripts import from it.

zeal keeps ZeRO-3's per-parameter state in its own side table and hangs no ``ds_*``
attributes on parameters, so a script's ``hasattr(p, "ds_id")`` test is False and its
``p.ds_status == ZeroParamStatus.NOT_AVAILABLE`` filter selects nothing; gathering is
done with :class:`GatheredParameters` or by the engine itself."""

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
