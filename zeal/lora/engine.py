"""LoRA in the training engine: the apply-steps ``zeal.initialize`` calls (adapters on
the plain model first; after tensor parallelism, adapters split with their base) and
the engine-level operations (save a PEFT folder, run the base alone).

``save_adapter`` is collective: at ZeRO 3 the adapters' units are gathered one at a
time (the frozen base is walked but never kept), under tensor parallelism the split
factors are assembled from every tp rank; rank 0 writes the folder.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zeal.config import Config, ConfigError
from zeal.lora.apply import LoraState, adapters_disabled, apply_lora
from zeal.lora.peft_folder import write_adapter

__all__ = ["adapter_state", "disable_adapters", "lora_step", "lora_tp_step", "save_adapter"]


def lora_step(model: nn.Module, cfg: Config) -> LoraState | None:
    """The ``lora`` section applied to the plain model (None when off); config errors
    as :class:`ConfigError` naming ``lora``."""
    lc = cfg.lora
    if not lc.enabled:
        return None
    if cfg.pipeline_parallel.size > 1 and (lc.modules_to_save or lc.bias != "none"):
        raise ConfigError("lora.modules_to_save and lora.bias are not supported with pipeline_parallel.size > 1 "
                          "(only the low-rank factors are gathered across stages)")
    if any(p.is_meta for p in model.parameters()):
        raise ConfigError("lora needs the base model's weights loaded: the model is on the meta device "
                          "(fine-tune a pretrained model: zeal train --model PATH --lora ...)")
    try:
        return apply_lora(model, lc, cfg.seed)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"lora: {e}") from None


def lora_tp_step(model: nn.Module, lora: LoraState | None, tp: Any) -> None:
    """After tensor parallelism: split the adapters with their base linears."""
    if lora is None or tp is None:
        return
    from zeal.lora.tp import split_lora_for_tp

    try:
        split_lora_for_tp(model, lora, tp)
    except ValueError as e:
        raise ConfigError(f"lora: {e}") from None


def _lora_of(engine: Any) -> LoraState:
    lora = getattr(engine, "lora", None)
    if lora is None:
        raise ValueError("this engine has no LoRA adapters (set lora.enabled in the config)")
    return lora


def adapter_state(engine: Any) -> dict[str, torch.Tensor]:
    """The adapters' and saved parameters' full tensors (fp32, CPU), identical on every
    rank; collective (every rank calls it)."""
    lora = _lora_of(engine)
    wanted = set(lora.lora_param_names()) | set(lora.saved)
    state: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, t in engine.iter_gathered_parameters():
            if name in wanted and name not in state:
                state[name] = t.detach().float().cpu().clone()
    tp = getattr(engine, "tensor_parallel", None)
    if tp is not None:
        from zeal.parallel.tensor import gather_full

        state = gather_full(tp, state)
    mesh = getattr(engine, "mesh", None)
    if mesh is not None and mesh.ep_size > 1:  # per-expert adapters: every expert from its ep rank
        from zeal.moe.layout import gather_experts

        state = gather_experts(mesh.ep, state, engine.module)
    if mesh is not None and mesh.pp_size > 1:
        state = _from_every_stage(mesh.pp, lora, wanted, state)
    missing = wanted - set(state)
    if missing:
        raise RuntimeError(f"adapter parameters not found in the engine: {sorted(missing)[:3]}")
    return state


def _from_every_stage(pp: Any, lora: LoraState, wanted: set[str], state: dict[str, torch.Tensor]
                      ) -> dict[str, torch.Tensor]:
    """Under pipeline parallelism each stage holds its layers' adapters: every tensor is
    summed over the pp group from the one stage that has it (zeros elsewhere; shapes from
    the apply-step's record, which still holds the other stages' modules)."""
    shapes = {f"{m}.{k}.weight": tuple(getattr(mod, k).weight.shape) for m, mod in lora.modules.items()
              for k in ("lora_A", "lora_B")}
    out = {}
    for name in sorted(wanted):
        t = state.get(name)
        t = t.clone() if t is not None else torch.zeros(shapes[name])
        pp.all_reduce(t, "lora")
        out[name] = t
    return out


def save_adapter(engine: Any, path: str | os.PathLike) -> Path:
    """Write the engine's adapter as a PEFT folder at ``path`` (rank 0 writes; every
    rank must call it)."""
    lora = _lora_of(engine)
    adapter = lora.adapter_from_state(adapter_state(engine))
    if engine.rank == 0:
        write_adapter(path, adapter)
    return Path(path)


@contextlib.contextmanager
def disable_adapters(engine_or_model: Any) -> Iterator[None]:
    """``with disable_adapters(engine):`` forwards run the frozen base alone (the RLHF
    reference policy); a no-op for a model without adapters."""
    model = getattr(engine_or_model, "module", engine_or_model)
    with adapters_disabled(model):
        yield
