"""``deepspeed.ops.adagrad``: ``DeepSpeedCPUAdagrad`` as ``torch.optim.Adagrad`` (what
accelerate builds for a torch Adagrad under CPU offload)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["DeepSpeedCPUAdagrad"]


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """DeepSpeed's ``DeepSpeedCPUAdagrad(model_params, lr, eps, weight_decay, amsgrad,
    fp32_optimizer_states)``: Adagrad with L2 weight decay added to the gradient and ``eps``
    added after the square root, as torch's; ``amsgrad`` is accepted and unused, as in
    DeepSpeed; the states are fp32 (``fp32_optimizer_states=False`` is refused)."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0,
                 amsgrad: bool = False, fp32_optimizer_states: bool = True) -> None:
        if not fp32_optimizer_states:
            raise ValueError("deepspeed.ops.adagrad.DeepSpeedCPUAdagrad(fp32_optimizer_states=False) is not "
                             "supported by zeal: its optimizer states are fp32")
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)
