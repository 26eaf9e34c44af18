"""The offload apply-step: the optimizer over fp32 masters, placed where
``zero_optimization.offload_optimizer`` says.

* ``none``: masters and moments beside the model (on the device), one slice per rank;
* ``cpu`` (ZeRO-Offload): masters and moments in host memory, the step on the CPU;
  gradients cross down and updated values back through a
  :class:`~zeal.zero.offload.staging.Staging` (pinned when ``pin_memory``, on CUDA);
  with ``ratio`` < 1 (ZeRO-Offload++) only the last ``ratio`` share of the units, the
  others updated on the device;
* ``nvme`` (ZeRO-Infinity): masters and moments in swap files, streamed through a
  small buffer pool by zeal's own Adam/AdamW.

(Parameter offload is decided by the ZeRO step, which writes shards to their home as
it materialises them.)
"""

from __future__ import annotations

from typing import Any

import torch

from zeal.config import Config, ConfigError
from zeal.config.schema import check_optimizer_params
from zeal.dist.mesh import Mesh
from zeal.precision.loss_scaler import LossScaler
from zeal.zero.apply import ZeroParts, rank_folder
from zeal.zero.offload.staging import Staging
from zeal.zero.optimizer import GradNorm, ZeroOptimizer
from zeal.zero.swapped_optimizer import SwappedZeroOptimizer
from zeal.zero.units import FlatUnit


def apply_offload(cfg: Config, zero: ZeroParts, mesh: Mesh, optimizer: Any,
                  scaler: LossScaler | None, grad_norm: GradNorm | None = None) -> ZeroOptimizer | SwappedZeroOptimizer:
    """Build the ZeRO optimizer for ``zero``'s units; ``optimizer`` is the user's (an
    instance, a factory taking param groups, or None for the config's section);
    ``grad_norm``: how this rank's squared gradient norm is taken (None: plain; tensor
    parallelism gives its own)."""
    oo = cfg.zero_optimization.offload_optimizer
    staging = Staging(mesh.device, oo.pin_memory)  # the device/host boundary of the optimizer tiers
    if oo.device == "nvme":
        if optimizer is not None:
            raise ConfigError("zero_optimization.offload_optimizer.device 'nvme' builds its own Adam/AdamW "
                              "from the config's optimizer section; do not pass an optimizer")
        spec = cfg.optimizer
        try:
            check_optimizer_params(dict(spec.params) if spec else {})
            return SwappedZeroOptimizer(
                zero.units, zero.reducer, mesh.dp, zero.stage, spec.type if spec else "AdamW",
                dict(spec.params) if spec else {"lr": 1e-3}, cfg.gradient_clipping, scaler, zero.home,
                rank_folder(oo.nvme_path, mesh.rank), cfg.zero_optimization.sub_group_size,
                max(oo.buffer_count, 3), grad_norm, staging)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    inner = inner_optimizer(cfg, optimizer, zero.units)
    master_device = torch.device("cpu") if oo.device == "cpu" else None
    zopt = ZeroOptimizer(zero.units, zero.reducer, mesh.dp, zero.stage, inner, cfg.gradient_clipping, scaler,
                         zero.home, master_device, grad_norm, staging if oo.device == "cpu" else None,
                         offload_ratio=oo.ratio)
    zopt.bind(inner.param_groups)
    return zopt


def inner_optimizer(cfg: Config, optimizer: Any, units: list[FlatUnit]) -> torch.optim.Optimizer:
    """The ``torch.optim`` optimizer that will run over the masters (built over
    placeholders; :meth:`ZeroOptimizer.bind` points it at the masters)."""
    dummy = [torch.zeros(1, requires_grad=True)]
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if callable(optimizer):
        return optimizer(dummy)
    spec = cfg.optimizer
    name, params = (spec.type, dict(spec.params)) if spec else ("AdamW", {"lr": 1e-3})
    try:
        check_optimizer_params(params)  # again here: a Config's dict can be changed after validation
    except ValueError as e:
        raise ConfigError(str(e)) from None
    lookup = {k.lower(): getattr(torch.optim, k) for k in dir(torch.optim)
              if isinstance(getattr(torch.optim, k), type) and issubclass(getattr(torch.optim, k), torch.optim.Optimizer)}
    cls = lookup.get(name.lower())
    if cls is None or cls is torch.optim.LBFGS:
        raise ConfigError(f"config key 'optimizer.type': unknown or unsupported optimizer {name!r} "
                          "(Adam, AdamW, SGD or an elementwise torch.optim class)")
    if "betas" in params:
        params["betas"] = tuple(params["betas"])
    if cls in (torch.optim.Adam, torch.optim.AdamW) and not {"fused", "foreach"} & params.keys():
        # one pass over memory per tensor, no full-size temporaries: on CPU torch's default
        # is the per-tensor loop (measured 193 ms -> see bench/README.md for a 62M-element shard)
        params["fused"] = True
    try:
        n_groups = 1 + max((u.group for u in units), default=0)
        return cls([{"params": [torch.zeros(1, requires_grad=True)]} for _ in range(n_groups)], **params)
    except (TypeError, ValueError) as e:  # an unknown keyword, or a combination torch refuses
        raise ConfigError(f"config key 'optimizer.params': {name}: {e}") from None
