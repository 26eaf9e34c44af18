"""The LoRA apply-step: freeze a plain model and put low-rank adapters on the linears
the config names, before any other step (precision, tensor parallelism, ZeRO) sees the
model.

After :func:`apply_lora` the only trainable parameters are the adapters' factors
(``<module>.lora_A.weight (r, in)``, ``<module>.lora_B.weight (out, r)``), the
parameters of ``modules_to_save`` and, with ``bias`` ``"all"``/``"lora_only"``, biases;
so ZeRO builds masters, gradients and optimizer state for these alone, and stage 3
partitions the frozen base in units of its own. :func:`adapters_disabled` runs the
base alone (the RLHF reference policy: no second copy of the model).
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from zeal.config.lora import LoraConfig
from zeal.lora.layer import LoraLinear
from zeal.lora.peft_folder import (
    PeftAdapter,
    PeftLoraConfig,
    match_modules_to_save,
    match_target_modules,
    read_adapter,
)
from zeal.moe.layer import is_expert_param

__all__ = ["LoraState", "adapters_disabled", "apply_lora", "find_lora", "peft_config_from", "set_adapters_enabled"]

_INIT = {"default": True, "gaussian": "gaussian", "zeros_a": False}  # zeal's init -> PEFT's init_lora_weights
_FIELDS = {"r": "r", "alpha": "lora_alpha", "dropout": "lora_dropout", "target_modules": "target_modules",
           "exclude_modules": "exclude_modules", "modules_to_save": "modules_to_save",
           "layers_to_transform": "layers_to_transform", "use_rslora": "use_rslora", "bias": "bias"}


@dataclass
class LoraState:
    """What :func:`apply_lora` did: the PEFT config (``target_modules`` resolved to the
    adapted paths when it was ``"all-linear"``), the adapted modules by path, and the
    other trained parameters saved with the adapter (``modules_to_save``, biases)."""

    peft: PeftLoraConfig
    modules: dict[str, LoraLinear]
    saved: list[str] = field(default_factory=list)

    def lora_param_names(self) -> list[str]:
        """``<module>.lora_A.weight`` and ``<module>.lora_B.weight`` of every adapter."""
        return [f"{m}.{k}.weight" for m in self.modules for k in ("lora_A", "lora_B")]

    def adapter_from_state(self, state: dict[str, torch.Tensor]) -> PeftAdapter:
        """The PEFT adapter held in ``state`` (full tensors by parameter name)."""
        from zeal.lora.peft_folder import LoraPair

        # every adapted module in ``state``: with ep, other ranks' experts gathered in (not in self.modules
        # when the layer was built after init_process_group, holding only this rank's experts)
        paths = {n[: -len(".lora_A.weight")] for n in state if n.endswith(".lora_A.weight")} | set(self.modules)
        lora = {m: LoraPair(state[f"{m}.lora_A.weight"], state[f"{m}.lora_B.weight"],
                            self.modules[m].scaling if m in self.modules else self.peft.scaling_for(m))
                for m in sorted(paths)}
        return PeftAdapter(self.peft, lora, {n: state[n] for n in self.saved})


def peft_config_from(lc: LoraConfig) -> PeftLoraConfig:
    """The PEFT config of a ``lora`` section; with ``adapter``, the folder's config, where
    every key the section sets explicitly must agree (one line naming the first that does not)."""
    if lc.adapter:
        folder = read_adapter(lc.adapter).config
        for key in sorted(lc.model_fields_set & set(_FIELDS)):
            ours, theirs = getattr(lc, key), getattr(folder, _FIELDS[key])
            if key == "modules_to_save":
                ours, theirs = list(ours or []), list(theirs or [])
            if ours != theirs and not (isinstance(ours, float) and float(theirs) == ours):
                raise ValueError(f"lora.{key} = {ours!r} disagrees with {lc.adapter}/adapter_config.json "
                                 f"({_FIELDS[key]} = {theirs!r}); leave it out to take the folder's")
        return folder
    return PeftLoraConfig(
        r=lc.r, lora_alpha=lc.alpha, target_modules=lc.target_modules, exclude_modules=lc.exclude_modules,
        modules_to_save=list(lc.modules_to_save) or None, lora_dropout=lc.dropout, use_rslora=lc.use_rslora,
        bias=lc.bias, init_lora_weights=_INIT[lc.init], layers_to_transform=lc.layers_to_transform)


def _head_names(model: nn.Module) -> set[str]:
    heads = set()
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else getattr(model, "lm_head", None)
    for name, m in model.named_modules():
        if head is not None and m is head:
            heads.add(name)
    return heads or {"lm_head"}


def _set_module(model: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def apply_lora(model: nn.Module, lc: LoraConfig | PeftLoraConfig, seed: int = 0, *,
               quantize_base: str | None = None, quant_block_size: int | None = None) -> LoraState:
    """Freeze ``model`` and adapt the linears ``lc`` targets (in place); see the module
    docstring. ``lc`` is a ``lora`` config section or a PEFT config; adapter weights come
    from the section's ``adapter`` folder, else from PEFT's initialisation with a
    generator seeded by ``seed`` (so every rank draws the same). Raises ValueError (one
    line) for a target that matches nothing, a target that is not a linear, or an adapter
    folder that does not fit the model. An MoE expert's linear gets an adapter of its own,
    marked as an expert parameter (it lives on the expert's ep rank, reduced over edp)."""
    section = lc if isinstance(lc, LoraConfig) else None
    peft = peft_config_from(lc) if section is not None else lc
    quant = quantize_base if quantize_base is not None else (section.quantize_base if section else "none")
    block = quant_block_size or (section.quant_block_size if section else 64)
    if any(isinstance(m, LoraLinear) for m in model.modules()):
        raise ValueError("the model already has LoRA adapters")
    names = [n for n, _ in model.named_modules()]
    linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    targets = match_target_modules(peft, names, linear, _head_names(model))
    if not targets:
        raise ValueError(f"lora.target_modules {peft.target_modules!r} matches no module of "
                         f"{type(model).__name__} (linears: {', '.join(sorted({n.rsplit('.', 1)[-1] for n in linear}))})")
    for t in targets:
        m = model.get_submodule(t)
        if not isinstance(m, nn.Linear):
            raise ValueError(f"lora target '{t}' is a {type(m).__name__}; zeal adapts nn.Linear modules only")
    for p in model.parameters():
        p.requires_grad_(False)
    how = {True: "default", "gaussian": "gaussian", False: "zeros_a"}[peft.init_lora_weights]
    modules: dict[str, LoraLinear] = {}
    for t in targets:
        base = model.get_submodule(t)
        mod = LoraLinear(base, peft.rank_for(t), peft.scaling_for(t), peft.lora_dropout, quant, block)
        # one generator per module path: an adapter's init does not depend on which other modules this
        # rank holds (MoE experts built after init_process_group, pipeline stages)
        mod.init_adapter(how, torch.Generator().manual_seed((int(seed) * 1_000_003 + zlib.crc32(t.encode())) % 2**63))
        if base.weight is not None and is_expert_param(base.weight):  # a per-expert adapter lives with its expert
            for f in (mod.lora_A.weight, mod.lora_B.weight):
                f.allreduce, f.group_name = False, getattr(base.weight, "group_name", None)
        _set_module(model, t, mod)
        modules[t] = mod
    saved: list[str] = []
    params = dict(model.named_parameters(remove_duplicate=False))
    for m in match_modules_to_save(peft, names):
        saved += [f"{m}.{k}" for k, _ in model.get_submodule(m).named_parameters()]
    if peft.bias == "all":
        saved += [n for n in params if n.endswith(".bias") or n == "bias"]
    elif peft.bias == "lora_only":
        saved += [f"{t}.bias" for t, mod in modules.items() if mod.bias is not None]
    saved = list(dict.fromkeys(saved))
    for n in saved:
        params[n].requires_grad_(True)
    if isinstance(peft.target_modules, str) and peft.target_modules.lower() == "all-linear":
        peft.target_modules = sorted(targets)  # what PEFT itself writes after resolving it
    state = LoraState(peft, modules, saved)
    if section is not None and section.adapter:
        load_adapter_weights(model, state, read_adapter(section.adapter), section.adapter)
    return state


@torch.no_grad()
def load_adapter_weights(model: nn.Module, state: LoraState, adapter: PeftAdapter, source: str = "adapter") -> None:
    """Copy a PEFT adapter's tensors into the model's adapters and saved parameters; every
    tensor must have a home of the same shape (one line naming the first that has not)."""
    for m, pair in adapter.lora.items():
        mod = state.modules.get(m)
        if mod is None:
            raise ValueError(f"{source}: adapter module '{m}' is not a LoRA target of this model")
        for got, want, k in ((pair.A, mod.lora_A.weight, "lora_A"), (pair.B, mod.lora_B.weight, "lora_B")):
            if tuple(got.shape) != tuple(want.shape):
                raise ValueError(f"{source}: {m}.{k} has shape {tuple(got.shape)}, the model's is {tuple(want.shape)}")
            want.copy_(got)
    params = dict(model.named_parameters(remove_duplicate=False))
    for n, t in adapter.saved.items():
        p = params.get(n)
        if p is None:
            raise ValueError(f"{source}: tensor '{n}' has no parameter of that name in the model")
        if tuple(p.shape) != tuple(t.shape):
            raise ValueError(f"{source}: '{n}' has shape {tuple(t.shape)}, the model's is {tuple(p.shape)}")
        p.copy_(t)


def find_lora(model: nn.Module) -> dict[str, LoraLinear]:
    """The model's LoRA linears by path (empty without adapters)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLinear)}


def set_adapters_enabled(model: nn.Module, enabled: bool) -> None:
    """Switch every adapter of ``model`` on or off (off: the frozen base alone)."""
    for m in model.modules():
        if isinstance(m, LoraLinear):
            m.adapter_enabled = enabled


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """``with adapters_disabled(model):`` the base model alone (PEFT's ``disable_adapter``);
    ``modules_to_save`` are trained in place, so they keep their trained values."""
    mods = [m for m in model.modules() if isinstance(m, LoraLinear)]
    before = [m.adapter_enabled for m in mods]
    for m in mods:
        m.adapter_enabled = False
    try:
        yield
    finally:
        for m, b in zip(mods, before):
            m.adapter_enabled = b
