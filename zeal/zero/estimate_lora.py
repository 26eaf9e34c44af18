"""Memory planner for LoRA / QLoRA: the plan of :func:`zeal.zero.estimate.plan` when only
low-rank adapters train on a frozen (optionally quantized) base.

With Ψ parameters, T trainable (the adapters: ``r (in + out)`` per adapted linear, plus
``modules_to_save``), Q elements of adapted weights stored quantized (QLoRA, else 0) and
c the compute dtype's bytes, per rank:

* adapter states: :func:`~zeal.zero.estimate.model_state_bytes` of T (params, gradients,
  optimizer state: masters and moments exist for the adapters alone);
* frozen base: ``c (Ψ - T - Q)``, partitioned at stage 3 (``c ceil((Ψ - T - Q) / N)``), no
  gradient, no master, no moment;
* quantized base: ``Q`` codes of 1 byte (int8) or 1/2 byte (int4) plus one fp32 scale per
  ``quant_block_size`` inputs, replicated on every rank (not partitioned);
* working memory: the full model's activations (the frozen base still back-propagates
  to its inputs) plus each adapted linear's ``(tokens, r)`` low-rank activation, plus,
  with QLoRA, one dequantized weight in backward; gradient buffers, step temporaries and
  heap slack of the T trainable elements; stage 3's gathered units as for the full model.

Pure functions of the shape; no torch. The adapted linears come from the shape
(:func:`block_linears`: Llama-style names for a gated MLP, GPT-2's otherwise).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from zeal.zero.estimate import (
    HOST_BASELINE_BYTES,
    HOST_HEAP_SLACK_BYTES,
    ModelShape,
    Plan,
    StateBytes,
    activation_parts,
    gathered_bytes,
    grad_buffer_bytes,
    model_state_bytes,
    place_states,
    shard,
    step_temporary_bytes,
)

__all__ = ["LoraSpec", "adapted_linears", "block_linears", "lora_plan", "quantized_weight_bytes"]


@dataclass(frozen=True)
class LoraSpec:
    """What the planner needs of a ``lora`` section."""

    r: int = 8
    target_modules: tuple[str, ...] | str = ("q_proj", "v_proj")
    modules_to_save: tuple[str, ...] = ()
    quantize_base: str = "none"
    quant_block_size: int = 64
    kv_heads: int | None = None  # the model's key/value heads (None: as many as query heads)
    head_dim: int | None = None  # None: hidden / heads

    @classmethod
    def from_config(cls, lc, kv_heads: int | None = None, head_dim: int | None = None) -> LoraSpec:
        """From a :class:`zeal.config.lora.LoraConfig`."""
        tm = lc.target_modules if isinstance(lc.target_modules, str) else tuple(lc.target_modules)
        return cls(lc.r, tm, tuple(lc.modules_to_save), lc.quantize_base, lc.quant_block_size, kv_heads, head_dim)

    def plan(self, shape: ModelShape, world_size: int, stage: int, offload: str, **kw: Any) -> Plan:
        """:func:`lora_plan` of this spec: how :func:`zeal.zero.estimate.plan` (``lora=``) plans
        it (:class:`zeal.zero.estimate.Variant`)."""
        return lora_plan(shape, world_size, stage, offload, self, **kw)


def block_linears(shape: ModelShape, kv_heads: int | None = None, head_dim: int | None = None
                  ) -> list[tuple[str, int, int]]:
    """``(name, in, out)`` of one block's linears: q/k/v/o + gate/up/down for a gated MLP
    (``shape.mlp_tensors == 4``), else GPT-2's ``attn.c_attn``, ``attn.c_proj``, ``mlp.c_fc``,
    ``mlp.c_proj``."""
    h, heads = shape.hidden, shape.n_head
    hd = head_dim or h // heads
    kv = kv_heads or heads
    if shape.mlp_tensors == 4:
        return [("q_proj", h, heads * hd), ("k_proj", h, kv * hd), ("v_proj", h, kv * hd), ("o_proj", heads * hd, h),
                ("gate_proj", h, shape.intermediate), ("up_proj", h, shape.intermediate),
                ("down_proj", shape.intermediate, h)]
    return [("attn.c_attn", h, 3 * h), ("attn.c_proj", h, h), ("mlp.c_fc", h, shape.intermediate),
            ("mlp.c_proj", shape.intermediate, h)]


def _matches(target: tuple[str, ...] | str, name: str) -> bool:
    if isinstance(target, str):
        return target.lower() == "all-linear" or re.fullmatch(target, name) is not None
    return any(name == t or name.endswith(f".{t}") for t in target)


def adapted_linears(shape: ModelShape, spec: LoraSpec) -> list[tuple[int, int]]:
    """``(in, out)`` of every adapted linear of the model (all blocks); ValueError when
    the targets match none."""
    block = block_linears(shape, spec.kv_heads, spec.head_dim)
    out = [(i, o) for name, i, o in block if _matches(spec.target_modules, name)]
    if not out:
        names = ", ".join(n for n, _, _ in block)
        raise ValueError(f"lora.target_modules {spec.target_modules!r} matches none of the block's linears ({names})")
    return out * shape.n_layer


def quantized_weight_bytes(inp: int, out: int, kind: str, block: int) -> int:
    """Codes plus fp32 scales of a quantized ``(out, in)`` weight (:mod:`zeal.lora.quant`)."""
    codes = out * inp if kind == "int8" else out * inp // 2
    return codes + 4 * out * math.ceil(inp / block)


def lora_plan(shape: ModelShape, world_size: int, stage: int, offload: str, spec: LoraSpec, *,
              micro_batch: int = 1, seq_len: int = 1024, mixed_precision: bool = True,
              flash_attention: bool = True, checkpointing: bool = False, host: bool = True) -> Plan:
    """Where each byte lives, per rank, at the peak of a LoRA step (module docstring)."""
    linears = adapted_linears(shape, spec)
    saved = shape.vocab_size * shape.hidden if "lm_head" in spec.modules_to_save else 0
    trainable = sum(spec.r * (i + o) for i, o in linears) + saved
    quant = spec.quantize_base != "none"
    q_elems = sum(i * o for i, o in linears) if quant else 0
    q_bytes = sum(quantized_weight_bytes(i, o, spec.quantize_base, spec.quant_block_size) for i, o in linears) \
        if quant else 0
    c = 2 if mixed_precision else 4
    frozen_elems = shape.num_params - saved - q_elems  # Ψ counts the base; the adapters come on top
    frozen = c * (shard(frozen_elems, world_size) if stage == 3 else frozen_elems)
    adapter = model_state_bytes(trainable, world_size, stage, mixed_precision)
    states = StateBytes(adapter.params + frozen + q_bytes, adapter.grads, adapter.optimizer)
    kept, transient = activation_parts(shape, micro_batch, seq_len, c, flash_attention, checkpointing)
    low_rank = c * micro_batch * seq_len * spec.r * len(linears) // shape.n_layer  # per block
    kept += low_rank * (1 if checkpointing else shape.n_layer)
    if quant:  # backward dequantizes one weight at a time
        transient += c * max(i * o for i, o in linears)
    full_buffers = grad_buffer_bytes(shape, world_size, stage, c)
    buffers = min(full_buffers, c * (trainable + shard(trainable, world_size))) if stage >= 2 else 0
    gathered = gathered_bytes(shape, stage, c)
    temps = step_temporary_bytes(trainable, world_size, stage, mixed_precision)
    baseline = HOST_BASELINE_BYTES if host else 0
    slack = min(HOST_HEAP_SLACK_BYTES, kept + transient + c * trainable) if host and stage < 3 and "nvme" not in offload \
        else 0
    # the adapters' optimizer step runs where their state is; the quantized base stays on the device
    on_device, cpu, nvme = place_states(states, temps, offload, stay=q_bytes)
    working = max(kept + transient + buffers + gathered, (temps if offload == "none" else 0) + buffers)
    notes = [f"lora: {trainable:,} trainable, frozen base {frozen:,} B"
             + (f", {spec.quantize_base} base {q_bytes:,} B (replicated)" if quant else "")]
    return Plan(stage, offload, states, gathered, kept + transient, baseline + slack + on_device + working, cpu, nvme,
                micro_batch, checkpointing, kept, buffers, temps, baseline, slack, shape.n_layer, notes)
