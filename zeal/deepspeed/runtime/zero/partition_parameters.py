"""``deepspeed.runtime.zero.partition_parameters``: the names scripts import from it.

zeal keeps ZeRO-3's per-parameter state in its own side table. For scripts written
against DeepSpeed, ``deepspeed.initialize`` at stage 3 gives the model's parameters
DeepSpeed's markers (``ds_id``, ``ds_numel``, ``ds_shape``, ``ds_status``; see
:func:`zeal.deepspeed.zero.mark_partitioned`), so their ``hasattr(p, "ds_id") and
p.ds_status == ZeroParamStatus.NOT_AVAILABLE`` test selects the parameters to gather with
:class:`GatheredParameters` (inside it they read AVAILABLE)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zeal.deepspeed.accelerator import get_accelerator
from zeal.deepspeed.zero import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    ZeroParamType,
    register_external_parameter,
    unregister_external_parameter,
)

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "ZeroParamType", "get_accelerator",
           "register_external_parameter", "unregister_external_parameter", "zero_wrapper_for_fp_tensor_constructor"]

_orig_torch_arange = torch.arange  # what transformers' prevent_arange_dtype_change compares with


def zero_wrapper_for_fp_tensor_constructor(fn: Callable, target_fp_dtype: torch.dtype | None = None,
                                           target_device: Any = None) -> Callable:
    """DeepSpeed's hook for the tensor constructors its ``Init`` patches. zeal's ``Init``
    patches none (it builds on the meta device, or whole on the CPU when given a config), so
    the constructor is returned as it is; transformers swaps this name around ``Init``."""
    del target_fp_dtype, target_device
    return fn
