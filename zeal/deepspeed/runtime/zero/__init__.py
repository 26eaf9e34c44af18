"""``deepspeed.runtime.zero`` (also ``deepspeed.zero``): ``Init``, ``GatheredParameters``,
``register_external_parameter``, ``ZeroParamStatus`` / ``ZeroParamType`` and
``unwrap_model_for_generation`` (see :mod:`zeal.deepspeed.zero`)."""

from zeal.deepspeed.runtime.zero.partition_parameters import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    ZeroParamType,
    register_external_parameter,
    unregister_external_parameter,
)
from zeal.deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "ZeroParamType", "register_external_parameter",
           "unregister_external_parameter", "unwrap_model_for_generation"]
