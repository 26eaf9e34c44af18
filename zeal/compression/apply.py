"""The compression apply-step: ``apply_compression(model, cfg.compression)``.

Before ZeRO (``initialize`` calls it after activation checkpointing): the target linears
are chosen by name and, for QAT, replaced by :class:`~zeal.compression.modules.QATLinear`
over the same Parameters, so ZeRO flattens the same parameters under the same names.
After ZeRO and the optimizer exist, :meth:`CompressionParts.step_hooks` builds the step
hooks over the optimizer's fp32 master shards: :class:`~zeal.compression.hooks.SparsityHook`
(ADMM, hard pruning, masked retraining) and :class:`QuantScheduleHook` (when QAT begins
and how many bits it uses).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn

from zeal.compression.admm import RhoSchedule
from zeal.compression.hooks import SparsityHook, SparsitySchedule
from zeal.compression.modules import QATLinear, QuantSpec, linear_targets, swap_qat
from zeal.compression.nm import check_groupable, parse_pattern
from zeal.compression.sharded import ShardedParams, TargetSpec
from zeal.config import ConfigError
from zeal.config.compression import CompressionConfig, QuantizationConfig, SparsityConfig

__all__ = ["CompressionParts", "QuantScheduleHook", "apply_compression", "rho_schedule"]


@dataclass
class CompressionParts:
    """What the apply-step adds: the sparsified weights (by parameter name) and the QAT
    linears, and the config they follow."""

    cfg: CompressionConfig
    sparse: dict[str, TargetSpec] = field(default_factory=dict)
    qat: dict[str, QATLinear] = field(default_factory=dict)

    def step_hooks(self, zopt, comm) -> list:
        """The hooks to register with the engine (``zopt``: the ZeRO optimizer; ``comm``:
        the data-parallel Comm its masters are partitioned over)."""
        hooks: list = []
        if self.sparse:
            inner = getattr(zopt, "optimizer", None)
            if not isinstance(inner, torch.optim.Optimizer) or not hasattr(zopt, "masters"):
                raise ConfigError("config key 'compression.sparsity': needs masters in memory (not "
                                  "zero_optimization.offload_optimizer.device 'nvme')")
            sc = self.cfg.sparsity
            sp = ShardedParams(zopt.units, zopt.masters, zopt.stage.owned_start, zopt.stage.partitions_optimizer,
                               comm, self.sparse)
            schedule = SparsitySchedule(sc.method, sc.prune_step, sc.admm_interval, rho_schedule(sc), sc.admm_penalty)
            hooks.append(SparsityHook(sp, inner, zopt.write_back, schedule, verbose=sc.log_residuals))
        if self.qat:
            hooks.append(QuantScheduleHook(list(self.qat.values()), self.cfg.quantization))
        return hooks


def rho_schedule(sc: SparsityConfig) -> RhoSchedule:
    """ρ's schedule: ``rho_growth`` as given, or (None) the geometric growth from ``rho`` at the
    first Z-step to ``rho_max`` at the last one of the ADMM phase (as ``zeal compress``)."""
    growth = sc.rho_growth
    if growth is None:
        zsteps = max(1, sc.prune_step // sc.admm_interval)
        growth = (sc.rho_max / sc.rho) ** (1 / max(1, zsteps - 1))
    return RhoSchedule(sc.rho, growth, sc.rho_max)


class QuantScheduleHook:
    """Turns QAT on after ``start_step`` optimizer steps, and steps the width down from
    ``start_bits`` to ``bits`` by one bit every ``quantization_period`` steps."""

    def __init__(self, linears: list[QATLinear], qc: QuantizationConfig) -> None:
        self.linears, self.qc, self.steps = linears, qc, 0
        self._set()

    def bits_now(self) -> int:
        qc = self.qc
        start = qc.start_bits if qc.start_bits is not None else qc.bits
        done = max(0, self.steps - qc.start_step) // qc.quantization_period
        return max(qc.bits, start - done)

    def _set(self) -> None:
        active, bits = self.steps >= self.qc.start_step, self.bits_now()
        for lin in self.linears:
            lin.active = active
            if lin.spec.bits != bits:
                lin.spec = replace(lin.spec, bits=bits)

    def after_step(self, applied: bool) -> None:
        if applied:
            self.steps += 1
            self._set()


def apply_compression(model: nn.Module, cfg: CompressionConfig) -> CompressionParts:
    """Choose the target linears, swap in QAT linears; see the module docstring."""
    parts = CompressionParts(cfg)
    sc, qc = cfg.sparsity, cfg.quantization
    if sc.enabled:
        if sc.method == "admm" and sc.prune_step == 0:
            raise ConfigError("config key 'compression.sparsity.prune_step': method 'admm' needs an ADMM phase "
                              "(prune_step > 0)")
        if sc.method == "admm" and sc.admm_metric == "activation":
            raise ConfigError("config key 'compression.sparsity.admm_metric': 'activation' needs calibration "
                              "statistics the engine does not gather; use 'euclidean' here or `zeal compress`")
        if sc.method == "admm" and sc.rho > sc.rho_max:
            raise ConfigError(f"config key 'compression.sparsity.rho': {sc.rho} is above rho_max {sc.rho_max}")
        n, m = parse_pattern(sc.pattern)
        targets = linear_targets(model, sc.modules, sc.exclude_modules)
        if not targets:
            raise ConfigError(f"config key 'compression.sparsity.modules': no nn.Linear matches {sc.modules} "
                              "(Hugging Face GPT-2's Conv1D layers are not supported yet)")
        for name, lin in targets.items():
            try:
                check_groupable(tuple(lin.weight.shape), m, -1, f"{name}.weight")
            except ValueError as e:
                raise ConfigError(f"config key 'compression.sparsity.pattern': {e}") from None
            parts.sparse[f"{name}.weight"] = TargetSpec(n, m, -1)
    if qc.enabled:
        targets = linear_targets(model, qc.modules, qc.exclude_modules)
        if not targets:
            raise ConfigError(f"config key 'compression.quantization.modules': no nn.Linear matches {qc.modules} "
                              "(Hugging Face GPT-2's Conv1D layers are not supported yet)")
        if qc.group_size is not None:
            bad = [n for n, lin in targets.items() if lin.in_features % qc.group_size]
            if bad:
                raise ConfigError(f"config key 'compression.quantization.group_size': {bad[0]} has "
                                  f"{targets[bad[0]].in_features} inputs, not a multiple of {qc.group_size}")
        swap_qat(model, targets, QuantSpec(qc.bits, qc.group_size, qc.activation_bits))
        parts.qat = {n: model.get_submodule(n) for n in targets}
    return parts
