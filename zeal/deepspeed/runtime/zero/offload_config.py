"""``deepspeed.runtime.zero.offload_config``: DeepSpeed's offload enums, which scripts use
to name devices and states (``engine.offload_states`` itself is refused: zeal's offload is
configured in ``zero_optimization.offload_*``, not toggled at run time)."""

from __future__ import annotations

from enum import Enum


class OffloadDeviceEnum(str, Enum):
    """Where an offload goes: ``none``, ``cpu`` or ``nvme``."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """Which engine state ``offload_states(include=...)`` names."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"
