"""``deepspeed.ops.adam``: ``FusedAdam`` and ``DeepSpeedCPUAdam`` as ``torch.optim.Adam``.

Both take DeepSpeed's arguments with DeepSpeed's meaning: ``adam_w_mode`` /
``adamw_mode`` True (the default) decays weights decoupled from the gradient (AdamW),
False adds ``weight_decay · p`` to the gradient (Adam's L2). Bias correction is always
on (``bias_correction=False`` is refused: torch's Adam has no such switch), and
``amsgrad`` is refused as DeepSpeed refuses it. Given to ``deepspeed.initialize``, the
optimizer steps zeal's fp32 masters (ZeRO shards, offloaded or not) with these settings.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


def _check(name: str, bias_correction: bool, amsgrad: bool) -> None:
    if not bias_correction:
        raise ValueError(f"deepspeed.ops.adam.{name}(bias_correction=False) is not supported by zeal "
                         "(torch's Adam always corrects the bias)")
    if amsgrad:
        raise ValueError(f"deepspeed.ops.adam.{name}(amsgrad=True) is not supported (nor by DeepSpeed); "
                         "use torch.optim.Adam(amsgrad=True)")


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's ``FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode,
    weight_decay, amsgrad, set_grad_none)``; ``adam_w_mode=True`` is AdamW."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True) -> None:
        _check("FusedAdam", bias_correction, amsgrad)
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adam_w_mode)
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none


class DeepSpeedCPUAdam(torch.optim.Adam):
    """DeepSpeed's ``DeepSpeedCPUAdam(model_params, lr, bias_correction, betas, eps,
    weight_decay, amsgrad, adamw_mode, fp32_optimizer_states)``; ``adamw_mode=True`` is
    AdamW. The states are fp32 (``fp32_optimizer_states=False`` is refused)."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        _check("DeepSpeedCPUAdam", bias_correction, amsgrad)
        if not fp32_optimizer_states:
            raise ValueError("deepspeed.ops.adam.DeepSpeedCPUAdam(fp32_optimizer_states=False) is not supported by "
                             "zeal: its optimizer states are fp32")
        super().__init__(model_params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adamw_mode)
        self.adamw_mode = adamw_mode
