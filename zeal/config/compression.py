"""The ``compression`` config section: N:M sparsity and quantization-aware training.

Example::

    "compression": {
      "sparsity": {"enabled": true, "pattern": "2:4", "method": "admm", "prune_step": 200,
                   "admm_interval": 10, "admm_penalty": "prox", "rho": 0.3, "rho_max": 10.0},
      "quantization": {"enabled": true, "bits": 4, "group_size": 128, "activation_bits": 8}
    }

DeepSpeed's ``compression_training`` keys that map onto these are translated by
``ds_compat`` (weight and activation quantization, N:M ``sparse_pruning``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

DEFAULT_EXCLUDE = ["lm_head", "*.lm_head"]


def parse_pattern(pattern: str | tuple[int, int]) -> tuple[int, int]:
    """``"2:4"`` (or ``(2, 4)``) → ``(n, m)`` with ``1 <= n <= m``; ValueError otherwise."""
    if isinstance(pattern, tuple):
        n, m = pattern
    else:
        parts = str(pattern).split(":")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"sparsity pattern must read N:M (for example 2:4), got {pattern!r}")
        n, m = (int(p) for p in parts)
    if not 1 <= n <= m:
        raise ValueError(f"sparsity pattern {n}:{m}: need 1 <= N <= M")
    return n, m


class Section(BaseModel):  # as schema.Section (which imports this module)
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class SparsityConfig(Section):
    enabled: bool = Field(False, description="Learn or impose N:M sparsity on the target linears.")
    pattern: str = Field("2:4", description="N:M: keep N of every M consecutive weights along the input dimension.")
    method: Literal["magnitude", "admm"] = Field(
        "magnitude", description="magnitude: prune by |w| at prune_step; admm: ADMM (NxMTransformer) until "
        "prune_step, then hard pruning. Masked retraining follows in both.")
    prune_step: int = Field(0, ge=0, description="Optimizer steps before hard pruning (0: prune at start); "
                            "for admm, the length of the ADMM phase (must then be > 0).")
    admm_interval: int = Field(10, ge=1, description="ADMM: Z and U are updated every this many optimizer steps.")
    admm_penalty: Literal["prox", "grad"] = Field(
        "prox", description="ADMM: how the penalty ρ/2·‖W − Z + U‖² acts. prox: its exact proximal step on the "
        "fp32 masters right after every optimizer step (as `zeal compress`, whose measured best it is); grad: "
        "its gradient added to the masters' gradients (NxMTransformer's form; Adam normalises it, so ρ barely "
        "matters there).")
    admm_metric: Literal["euclidean", "activation"] = Field(
        "euclidean", description="ADMM: the penalty's and projection's metric. Only euclidean in `zeal train`: "
        "activation (`zeal compress`'s best, D_j = ‖X_j‖²) needs a calibration pass the engine does not run, "
        "and is refused.")
    rho: float = Field(0.3, gt=0, allow_inf_nan=False, description="ADMM penalty ρ at the start.")
    rho_growth: float | None = Field(
        None, ge=1.0, allow_inf_nan=False, description="ρ is multiplied by this at every Z-step (None: the "
        "geometric growth that takes ρ from rho to rho_max over the ADMM phase's Z-steps).")
    rho_max: float = Field(10.0, gt=0, allow_inf_nan=False, description="Upper bound of ρ.")
    log_residuals: bool = Field(False, description="Log ADMM's primal and dual residuals at every Z-step (rank 0).")
    modules: list[str] = Field(["*"], description="fnmatch patterns of the linear modules to sparsify.")
    exclude_modules: list[str] = Field(DEFAULT_EXCLUDE, description="fnmatch patterns of linears left dense.")

    @field_validator("pattern")
    @classmethod
    def _pattern(cls, v: str) -> str:
        parse_pattern(v)
        return v


class QuantizationConfig(Section):
    enabled: bool = Field(False, description="Quantization-aware training: fake-quantized weights (and activations).")
    bits: int = Field(8, ge=2, le=8, description="Weight bits (symmetric; 8 or 4 are the exported widths).")
    start_bits: int | None = Field(None, ge=2, le=8, description="Begin at this width and lose one bit every "
                                   "quantization_period steps down to bits (None: bits from the start).")
    quantization_period: int = Field(1, ge=1, description="Steps per bit when start_bits > bits.")
    start_step: int = Field(0, ge=0, description="Optimizer steps of full-precision training before QAT begins.")
    group_size: int | None = Field(None, ge=1, description="Weights per scale along the input dimension "
                                   "(None: one scale per output channel).")
    activation_bits: Literal[8] | None = Field(None, description="Per-tensor fake quantization of the linears' "
                                               "inputs (None: activations stay in floating point).")
    modules: list[str] = Field(["*"], description="fnmatch patterns of the linear modules to quantize.")
    exclude_modules: list[str] = Field(DEFAULT_EXCLUDE, description="fnmatch patterns of linears left unquantized.")


class CompressionConfig(Section):
    sparsity: SparsityConfig = Field(default_factory=SparsityConfig, description="N:M sparsity (magnitude or ADMM).")
    quantization: QuantizationConfig = Field(default_factory=QuantizationConfig, description="QAT of the linears.")
