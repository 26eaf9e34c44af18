"""Merging adapters into their base: ``W' = W + scaling * B @ A`` (in fp32).

* :func:`attach_adapter`: a PEFT folder put on a plain model (zeal's or Hugging Face's:
  module paths are the same) — what ``PeftModel.from_pretrained`` does;
* :func:`merge_and_unload`: every :class:`LoraLinear` of a model replaced by a plain
  ``nn.Linear`` holding the merged weight (a quantized base is dequantized first);
* :func:`merge_checkpoint_specs`: the ``zeal checkpoint export --merge-lora`` plan — a
  checkpoint's LoRA factors merged into its base tensors as they stream out, the
  factors and scales left out of the folder.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn

from zeal.lora.apply import LoraState, _set_module, apply_lora, load_adapter_weights
from zeal.lora.layer import LoraLinear
from zeal.lora.peft_folder import read_adapter
from zeal.lora.quant import dequantize

__all__ = ["LORA_SUFFIXES", "attach_adapter", "merge_and_unload", "merge_checkpoint_specs", "merged_weight"]

LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight", ".lora_scaling_q32", ".qweight", ".qscale")


def merged_weight(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``w + scaling * b @ a`` in fp32 (``w (out, in)``, ``a (r, in)``, ``b (out, r)``)."""
    return w.float() + scaling * (b.float() @ a.float())


def attach_adapter(model: nn.Module, folder: str | os.PathLike, *, quantize_base: str = "none",
                   quant_block_size: int = 64) -> LoraState:
    """Put the PEFT adapter of ``folder`` on ``model`` (frozen; the adapter's tensors loaded)."""
    adapter = read_adapter(folder)
    state = apply_lora(model, adapter.config, quantize_base=quantize_base, quant_block_size=quant_block_size)
    load_adapter_weights(model, state, adapter, str(folder))
    return state


@torch.no_grad()
def merge_and_unload(model: nn.Module) -> nn.Module:
    """Replace every LoRA linear of ``model`` by an ``nn.Linear`` with the merged weight
    (in the base's dtype, fp32 for a quantized base); returns ``model``."""
    for path, mod in [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLinear)]:
        w = mod.base_weight()
        dtype = w.dtype if mod.weight is not None else torch.float32
        merged = merged_weight(w, mod.lora_A.weight, mod.lora_B.weight, mod.scaling) if mod.adapter_enabled else w
        lin = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None, device="meta")
        lin.weight = nn.Parameter(merged.to(dtype), requires_grad=False)
        if mod.bias is not None:
            lin.bias = mod.bias
        _set_module(model, path, lin)
    return model


def merge_checkpoint_specs(specs: list, meta: dict, read_param: Callable[[str], torch.Tensor],
                           read_buffer: Callable[[str], torch.Tensor], dtype: torch.dtype,
                           transposed: set[str] = frozenset()) -> list:
    """The export's tensor specs with every adapted base weight merged and the LoRA
    tensors (factors, scales, quantized codes) left out. ``read_param(name)`` /
    ``read_buffer(name)`` read a saved tensor whole; ``transposed`` names outputs
    stored as the transpose of the model's tensor (GPT-2's ``Conv1D``)."""
    from zeal.checkpoint.files import TensorSpec

    params, buffers = meta["params"], meta.get("buffers", {})
    modules = sorted({k[: -len(".lora_A.weight")] for k in params if k.endswith(".lora_A.weight")})
    out = [s for s in specs if not s.name.endswith(LORA_SUFFIXES)]
    have = {s.name for s in out}
    for m in modules:
        if f"{m}.lora_scaling_q32" not in buffers:
            raise ValueError(f"LoRA module {m} has no lora_scaling_q32 in the checkpoint")
        name = f"{m}.weight"

        def produce(m: str = m, name: str = name) -> torch.Tensor:
            s = float(read_buffer(f"{m}.lora_scaling_q32").item()) / 2**32
            if name in params:
                w = read_param(name)
            else:  # QLoRA: the frozen base is stored as codes and scales
                codes = read_buffer(f"{m}.qweight")
                w = dequantize(codes, read_buffer(f"{m}.qscale"), "int4" if codes.dtype == torch.uint8 else "int8",
                               torch.float32)
            merged = merged_weight(w, read_param(f"{m}.lora_A.weight"), read_param(f"{m}.lora_B.weight"), s)
            return (merged.t() if name in transposed else merged).to(dtype).contiguous()

        if name in have:
            out = [TensorSpec(name, s.dtype, s.shape, produce) if s.name == name else s for s in out]
        else:
            codes = buffers[f"{m}.qweight"]["shape"]
            rows = codes[0]
            cols = params[f"{m}.lora_A.weight"]["shape"][1]
            shape = (cols, rows) if name in transposed else (rows, cols)
            out.append(TensorSpec(name, dtype, shape, produce))
    return out
