"""``deepspeed.utils``: ``logger``, ``log_dist``, ``RepeatingLoader``, ``groups``, ``OnDevice``.

``safe_get_full_*`` / ``safe_set_full_*`` and their ``local`` variants (one parameter's
fp32 master, gradient or optimizer state) are in :mod:`.tensor_fragment`. Names of
``deepspeed.utils`` that zeal does not have (DeepSpeed's fragment internals, ZeRO-3 leaf
ones) fail at the attribute with one line saying what to use; ZeRO-3 leaf-module marks
(:mod:`.z3_leaf_module`) are set and read as DeepSpeed's, and zeal needs none.
"""

from __future__ import annotations

from typing import Any

from zeal.deepspeed.refusals import refuse
from zeal.deepspeed.utils import groups
from zeal.deepspeed.utils.logging import log_dist, log_dist_once, logger, set_log_level_from_string
from zeal.deepspeed.utils.misc import OnDevice, RepeatingLoader
from zeal.deepspeed.utils.tensor_fragment import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
)
from zeal.deepspeed.utils.z3_leaf_module import (
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)

__all__ = ["OnDevice", "RepeatingLoader", "groups", "log_dist", "log_dist_once", "logger",
           "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
           "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state",
           "set_log_level_from_string", "get_z3_leaf_modules", "set_z3_leaf_module", "set_z3_leaf_modules",
           "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix", "unset_z3_leaf_modules", "z3_leaf_module",
           "z3_leaf_parameter"]

_SHARDED = ("use the safe_get_full_* / safe_set_full_* functions of deepspeed.utils, or engine.sharded_state() "
            "(zeal.zero.sharded_state)")
_REFUSED = {n: _SHARDED for n in (
    "safe_update_full_grad_vectorized", "get_full_hp_param", "get_full_hp_grad",
    "set_full_hp_param", "set_full_hp_grad", "tensor_fragment", "map_to_flat_opt_states")}


def __getattr__(name: str) -> Any:
    if name in _REFUSED:
        return refuse(f"deepspeed.utils.{name}", _REFUSED[name])
    raise AttributeError(f"module 'deepspeed.utils' has no attribute {name!r}")
