"""``deepspeed.moe.utils``: telling expert parameters apart."""

from __future__ import annotations

from typing import Any

from zeal.moe.layer import is_expert_param


def is_moe_param(param: Any) -> bool:
    """DeepSpeed's test: an expert parameter (``allreduce`` is False)."""
    return is_expert_param(param)


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any, max_group_size: int | None = None) -> list:
    """Each param group split in two: its non-expert parameters, then its expert ones
    (named ``<name>_moe``, ``moe = True``), as DeepSpeed does before building the
    optimizer. zeal reduces expert gradients over the expert-data group whatever the
    grouping, so this only keeps DeepSpeed scripts working. ``max_group_size`` is ignored."""
    del max_group_size
    groups = [param_groups] if isinstance(param_groups, dict) else list(param_groups)
    out = []
    for g in groups:
        params = list(g["params"])
        dense = {**g, "params": [p for p in params if not is_expert_param(p)]}
        experts = [p for p in params if is_expert_param(p)]
        out.append(dense)
        if experts:
            out.append({**g, "params": experts, "name": f"{g.get('name', 'group')}_moe", "moe": True})
    return out
