"""The ``lora`` config section: low-rank adapters on a frozen base (LoRA), optionally
over a quantized base (QLoRA).

Example::

    "lora": {"enabled": true, "r": 16, "alpha": 32, "dropout": 0.05,
             "target_modules": "all-linear", "modules_to_save": ["lm_head"],
             "quantize_base": "int4", "quant_block_size": 64}

``adapter`` names a PEFT adapter folder to start from: its ``adapter_config.json``
supplies r, alpha, targets ... (the keys set here must agree with it or be left out)
and its tensors the initial adapter weights. Names and patterns are PEFT's (see
:mod:`zeal.lora.peft_folder`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class LoraConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    enabled: bool = Field(False, description="Apply LoRA adapters and freeze the base model.")
    r: int = Field(8, ge=1, description="Adapter rank (PEFT's r).")
    alpha: float = Field(8.0, gt=0, allow_inf_nan=False, description="Scale numerator (PEFT's lora_alpha): "
                         "the update is alpha / r * B A x (alpha / sqrt(r) with use_rslora).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input (PEFT's lora_dropout).")
    target_modules: list[str] | str = Field(
        default_factory=lambda: ["q_proj", "v_proj"],
        description="Modules to adapt, as PEFT reads them: a list of names (a module matches when its path "
        "ends with '.name'), one string = a regex matching the whole module path, or 'all-linear' (every "
        "linear but the output head).")
    exclude_modules: list[str] | str | None = Field(None, description="Modules never adapted (as target_modules).")
    modules_to_save: list[str] = Field(default_factory=list, description="Modules trained whole and saved with "
                                       "the adapter (e.g. lm_head, embed_tokens).")
    layers_to_transform: list[int] | None = Field(None, description="Only these layer indices (with list targets).")
    use_rslora: bool = Field(False, description="Rank-stabilised scale alpha / sqrt(r).")
    init: Literal["default", "gaussian", "zeros_a"] = Field(
        "default", description="Initial A: 'default' = PEFT's (Kaiming-uniform A, B = 0), 'gaussian' = N(0, 1/r) "
        "A, B = 0; 'zeros_a' = B random, A = 0 (the product is still 0).")
    bias: Literal["none", "all", "lora_only"] = Field("none", description="Also train biases: of every module "
                                                     "('all') or of the adapted ones ('lora_only').")
    adapter: str | None = Field(None, description="A PEFT adapter folder to start from (its adapter_config.json "
                                "supplies r, alpha, targets ...; its tensors the initial weights).")
    quantize_base: Literal["none", "int8", "int4"] = Field(
        "none", description="QLoRA: store the adapted linears' frozen weights quantized (symmetric, per block of "
        "quant_block_size inputs, fp32 scales) and dequantize them per module in forward and backward.")
    quant_block_size: int = Field(64, ge=8, description="Inputs per quantization block (divides in_features).")

    @field_validator("target_modules")
    @classmethod
    def _not_empty(cls, v: list[str] | str) -> list[str] | str:
        if not v:
            raise ValueError("must name at least one module (e.g. ['q_proj', 'v_proj'] or 'all-linear')")
        return v
