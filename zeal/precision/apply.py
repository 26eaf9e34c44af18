"""The precision apply-step: the compute dtype, buffers cast to it, the fp16 loss scaler.

Trainable parameters take the compute dtype when ZeRO lays them out in flat units
(with fp32 masters in the optimizer); this step handles what ZeRO does not own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from zeal.config import Config
from zeal.precision.loss_scaler import LossScaler


@dataclass
class Precision:
    """What the precision step adds: the compute dtype and (fp16 only) a loss scaler."""

    dtype: torch.dtype
    scaler: LossScaler | None


def compute_dtype(cfg: Config) -> torch.dtype:
    """bf16, fp16 or fp32, as the config's ``bf16`` / ``fp16`` sections say."""
    return torch.bfloat16 if cfg.bf16.enabled else torch.float16 if cfg.fp16.enabled else torch.float32


def apply_precision(model: nn.Module, cfg: Config, device: torch.device,
                    init: Callable[[nn.Module], None]) -> Precision:
    """Move buffers to ``device``, floating-point ones in the compute dtype (meta buffers
    are materialised by their module's initialiser first)."""
    dtype = compute_dtype(cfg)
    for mod in model.modules():
        for name, b in list(mod.named_buffers(recurse=False)):
            if b is None:
                continue
            if b.is_meta:
                mod.to_empty(device=device, recurse=False)
                init(mod)
                b = getattr(mod, name)
            new = b.to(device=device, dtype=dtype if b.is_floating_point() else b.dtype)
            setattr(mod, name, new)
    return Precision(dtype, LossScaler(cfg.fp16) if cfg.fp16.enabled else None)
