"""LoRA in the RLHF trainers: the reference policy is the policy's own module with its
adapters switched off (no second copy of the model), the weights the hybrid engine
syncs into its serving copy are the merged ones (the serving model has no adapters),
and a critic never inherits the actor's ``lora`` section (its value head must train).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from zeal.lora.apply import adapters_disabled, find_lora
from zeal.lora.merge import merged_weight

__all__ = ["AdapterlessView", "lora_enabled", "reference_policy", "sync_stream", "without_lora"]


def lora_enabled(engine_cfg: dict | None) -> bool:
    """Whether an engine config dict turns LoRA on."""
    return bool(((engine_cfg or {}).get("lora") or {}).get("enabled"))


def without_lora(engine_cfg: dict) -> dict:
    """The config with LoRA off (for a critic or reward engine built beside a LoRA actor)."""
    cfg = copy.deepcopy(engine_cfg)
    cfg.pop("lora", None)
    return cfg


class AdapterlessView(nn.Module):
    """The policy's module seen with its adapters off: ``view(...)`` is ``module(...)`` under
    :func:`zeal.lora.apply.adapters_disabled`. It holds the same module object (the one
    the training engine wraps after ``zeal.initialize``), so it costs no memory; log-probs
    it gives are the frozen base's, whatever the adapters have learnt."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with adapters_disabled(self.module):
            return self.module(*args, **kwargs)


def reference_policy(model: nn.Module, engine_cfg: dict | None) -> nn.Module:
    """The RLHF reference: with LoRA on, :class:`AdapterlessView` of ``model`` (take it
    before ``zeal.initialize``, which puts the adapters on that same module); without, a
    frozen eval-mode copy. LoRA with ``modules_to_save`` is refused in one line: those
    modules train in place, so the base alone is no longer available."""
    if lora_enabled(engine_cfg):
        if (engine_cfg.get("lora") or {}).get("modules_to_save"):
            raise ValueError("rlhf with lora.modules_to_save is not supported: those modules train in place, so "
                             "the reference (the base with adapters disabled) would not be the base")
        return AdapterlessView(model)
    from zeal.rlhf.common import frozen_copy

    return frozen_copy(model)


@torch.no_grad()
def sync_stream(engine: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the actor for the serving copy: ``engine.iter_gathered_parameters()``
    as it is without adapters; with them, each adapted base weight merged
    (``W + scaling B A``, a quantized base dequantized) and the factors left out. At
    ZeRO-3 units come one at a time (a module's base weight before its ``lora_A`` and
    ``lora_B``), so a base weight is held (one matrix) until its factors arrive."""
    lora = find_lora(engine.module)
    if not lora:
        yield from engine.iter_gathered_parameters()
        return
    held: dict[str, torch.Tensor] = {}
    for name, t in engine.iter_gathered_parameters():
        mod_name, _, leaf = name.rpartition(".")
        if mod_name in lora and leaf == "weight":
            held[mod_name] = t.detach().clone()
            continue
        factor, _, _ = mod_name.rpartition(".")
        if factor in lora and mod_name.endswith((".lora_A", ".lora_B")):
            held[f"{factor}:{mod_name[-1]}"] = t.detach().clone()
            a, b = held.get(f"{factor}:A"), held.get(f"{factor}:B")
            if a is not None and b is not None:
                mod = lora[factor]
                w = held.pop(factor, None)
                if w is None:  # a quantized base: dequantized from its (replicated) codes
                    w = mod.base_weight(torch.float32)
                held.pop(f"{factor}:A")
                held.pop(f"{factor}:B")
                s = mod.scaling if mod.adapter_enabled else 0.0
                yield f"{factor}.weight", merged_weight(w, a, b, s).to(t.dtype)
            continue
        yield name, t


def export_lora(engine: Any, out: Any) -> None:
    """A LoRA job's results: ``out/adapter`` (a PEFT folder; every rank calls this) and, from
    the run's final checkpoint, ``out/model`` with the adapters merged (rank 0)."""
    from pathlib import Path

    out = Path(out)
    engine.save_adapter(str(out / "adapter"))
    if engine.rank == 0 and (out / "checkpoints").is_dir():
        from zeal.checkpoint.export import export_hf

        export_hf(out / "checkpoints", out / "model", merge_lora=True)
