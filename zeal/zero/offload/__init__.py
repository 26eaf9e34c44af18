"""Offload of optimizer state (and parameters) to CPU memory and to disk: ZeRO-Offload
(CPU optimizer, delayed parameter update) and ZeRO-Infinity (disk tier)."""

from zeal.zero.offload.cpu_adam import AdamState, CPUAdam, DelayedUpdate
from zeal.zero.offload.param_swap import ParamSwapper
from zeal.zero.offload.swap import (
    OPTIMIZER_PATH_KEY,
    PARAM_PATH_KEY,
    SwapStore,
    aligned_empty,
    check_swap_path,
)
from zeal.zero.offload.swapped_adam import SwappedAdam, SwapStepStats, sub_group_ranges

__all__ = [
    "AdamState", "CPUAdam", "DelayedUpdate", "OPTIMIZER_PATH_KEY", "PARAM_PATH_KEY", "ParamSwapper", "SwapStore",
    "SwapStepStats", "SwappedAdam", "aligned_empty", "check_swap_path", "sub_group_ranges",
]
