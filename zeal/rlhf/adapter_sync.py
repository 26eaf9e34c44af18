"""Adapter-only weight sync for RLHF with LoRA: the serving copy holds the frozen base once
and the adapters beside it, and each rollout's sync moves only the adapters (and any other
trained parameter: biases with ``lora.bias``).

:class:`ServingAdapters` puts, on every linear of the serving model that the actor adapts,
a forward hook adding ``(x A^T) (s B)^T`` from two tensors it owns (``A (r, in)`` and the
scaled ``B`` transposed, ``(r, out)``, in the serving dtype). The base linears are never
written after the first sync: their bytes (and any re-laid-out copy the serving engine
keeps of them, e.g. oneDNN's packed weights) stay as loaded, while generations follow the
adapters (``W x + s B (A x)``, the merged policy ``(W + s B A) x`` up to rounding).

:func:`base_stream` gives the first sync: the actor's parameters without the factors, each
quantized base (QLoRA) dequantized; :func:`adapter_stream` the later ones: the factors
alone, at ZeRO-3 gathering only the adapters' units (the base's are not touched).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from zeal.lora.layer import LoraLinear

__all__ = ["ServingAdapters", "adapter_names", "adapter_stream", "base_stream"]

_FACTORS = (".lora_A.weight", ".lora_B.weight")


def adapter_names(module: nn.Module, lora: dict[str, LoraLinear]) -> set[str]:
    """``<module>.lora_A.weight`` and ``<module>.lora_B.weight`` of every adapted module, and
    the other parameters that train (biases with ``lora.bias``): what changes between syncs."""
    return {f"{m}{k}" for m in lora for k in _FACTORS} | {n for n, p in module.named_parameters() if p.requires_grad}


def _split_factor(name: str) -> tuple[str, str] | None:
    for k in _FACTORS:
        if name.endswith(k):
            return name[: -len(k)], k[1:7]  # ("model.layers.0.q_proj", "lora_A")
    return None


@torch.no_grad()
def base_stream(engine: Any, lora: dict[str, LoraLinear], adapters: ServingAdapters) -> Iterator[tuple[str, torch.Tensor]]:
    """The actor's ``(name, tensor)`` for the serving copy's base (every rank together): the
    factors go to ``adapters`` as they pass, a quantized base is dequantized (its codes are
    replicated, nothing to gather)."""
    for name, t in engine.iter_gathered_parameters():
        if _split_factor(name) is not None:
            adapters.load([(name, t)])
            continue
        yield name, t
    for mod_name, mod in lora.items():
        if mod.weight is None:
            yield f"{mod_name}.weight", mod.base_weight(torch.float32)


def adapter_stream(engine: Any, lora: dict[str, LoraLinear]) -> Iterator[tuple[str, torch.Tensor]]:
    """The factors and other trained parameters alone (at ZeRO-3 only their units are gathered)."""
    return engine.iter_gathered_parameters(only=adapter_names(engine.module, lora))


class ServingAdapters:
    """The actor's adapters on a serving model (see the module docstring). ``lora``: the
    actor's LoRA linears by path (their ranks and scalings; an adapter switched off is
    served as zero); every path must name a linear of ``model`` with the same shape."""

    def __init__(self, model: nn.Module, lora: dict[str, LoraLinear]) -> None:
        self.lora = lora
        self.factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # path -> (A (r, in), (s B)^T (r, out))
        self._handles = []
        for name, mod in lora.items():
            try:
                lin = model.get_submodule(name)
            except AttributeError:
                raise ValueError(f"the serving model has no module {name!r} for the actor's adapter") from None
            if (getattr(lin, "in_features", None), getattr(lin, "out_features", None)) != (mod.in_features,
                                                                                          mod.out_features):
                raise ValueError(f"the serving model's {name} does not match the actor's adapted linear "
                                 f"({mod.out_features} x {mod.in_features})")
            w = lin.weight
            a = torch.zeros(mod.r, mod.in_features, dtype=w.dtype, device=w.device)
            bt = torch.zeros(mod.r, mod.out_features, dtype=w.dtype, device=w.device)
            self.factors[name] = (a, bt)
            self._handles.append(lin.register_forward_hook(_hook(a, bt)))

    @property
    def nbytes(self) -> int:
        """Bytes of the adapter tensors held for serving."""
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.factors.values())

    @torch.no_grad()
    def load(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Copy the factors among ``named`` in place (B scaled by its module's current
        scaling, 0 when the adapter is off); returns copies of the other tensors (a gathered
        tensor is valid only until the next one is asked for)."""
        rest = []
        for name, t in named:
            split = _split_factor(name)
            if split is None or split[0] not in self.factors:
                rest.append((name, t.detach().clone()))
                continue
            mod_name, which = split
            a, bt = self.factors[mod_name]
            if which == "lora_A":
                a.copy_(t)
            else:
                mod = self.lora[mod_name]
                s = mod.scaling if mod.adapter_enabled else 0.0
                bt.copy_((t.detach().float() * s).t())
        return rest

    def remove(self) -> None:
        """Take the hooks off the serving model."""
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _hook(a: torch.Tensor, bt: torch.Tensor):
    def add_adapter(_module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        x = args[0]
        return out + torch.matmul(torch.matmul(x.to(a.dtype), a.t()), bt).to(out.dtype)
    return add_adapter
