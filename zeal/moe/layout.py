"""The whole MoE model's layout, known on every expert-parallel rank (for checkpoints).

Each ep rank holds only its own experts, named by global index
(``<layer>.deepspeed_experts.<g>.<rest>``), but a checkpoint describes the whole model
so that it loads at any ep size: every expert of a layer is a deep copy of the same
module, so this rank's first local expert is the template of every other one. The
layout is derived locally (no communication): for each :class:`~zeal.moe.layer.Experts`
the names of the local experts are repeated for every global index, in module order
(what a single-process model with all experts lists).

The engine's ``global_params`` / ``global_state_dict_keys`` (see
:func:`zeal.zero.sharded_state.sharded_state` and :mod:`zeal.checkpoint.save`) are set
from here by ``zeal.initialize`` when ``ep > 1``. Expert buffers (rare) are written by
the first rank of each expert's data-parallel copies, others by rank 0
(:func:`writes_buffer`). :func:`gather_experts` completes a state dict with the other
ranks' experts (``engine.module_state_dict()``, ``save_16bit_model``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from zeal.moe.layer import Experts

V = TypeVar("V")


def expert_prefixes(module: nn.Module) -> dict[str, int]:
    """``"<path>.deepspeed_experts"`` → the layer's number of experts (all ranks'), for
    every expert container of ``module``."""
    out = {}
    for path, m in module.named_modules():
        if isinstance(m, Experts):
            out[f"{path}.deepspeed_experts" if path else "deepspeed_experts"] = m.num_experts
    return out


def split_expert_name(name: str, prefixes: dict[str, int]) -> tuple[str, int, str] | None:
    """``(prefix, global index, rest)`` of an expert tensor's name, None for others."""
    for p in prefixes:
        if name.startswith(p + "."):
            g, _, rest = name[len(p) + 1:].partition(".")
            if g.isdigit() and rest:
                return p, int(g), rest
    return None


def expand(items: dict[str, V], prefixes: dict[str, int], rename: Callable[[V, str], V]) -> dict[str, V]:
    """``items`` (name → value, in module order, this rank's experts only) with the
    entries of every expert of each layer, in global-index order, placed where the
    layer's local experts were; ``rename(value, new_name)`` adapts a template's value
    (``new_name`` is the expert's, the template's global index replaced)."""
    first: dict[str, int] = {}
    template: dict[str, list[tuple[str, V]]] = {}
    for name, v in items.items():
        s = split_expert_name(name, prefixes)
        if s is not None:
            p, g, rest = s
            if first.setdefault(p, g) == g:
                template.setdefault(p, []).append((rest, v))
    out: dict[str, V] = {}
    for name, v in items.items():
        s = split_expert_name(name, prefixes)
        if s is None:
            out[name] = v
        elif s[0] in template:
            p = s[0]
            for g in range(prefixes[p]):
                for rest, tv in template[p]:
                    new = f"{p}.{g}.{rest}"
                    out[new] = rename(tv, new)
            del template[p]
    return out


def global_layout(params: dict[str, Any], sd_keys: dict[str, list], module: nn.Module) -> tuple[dict, dict]:
    """The whole model's ParamInfos and state-dict keys from this rank's ones."""
    prefixes = expert_prefixes(module)

    def rename_key(v: list, new: str) -> list:
        kind, src = v
        s = split_expert_name(src, prefixes)
        if s is None:
            return list(v)
        g = split_expert_name(new, prefixes)
        return [kind, f"{s[0]}.{g[1] if g else s[1]}.{s[2]}"]

    infos = expand(params, prefixes, lambda info, new: dataclasses.replace(info, name=new))
    return infos, expand(sd_keys, prefixes, rename_key)


def set_global_layout(engine: Any) -> None:
    """Give an ep > 1 engine the whole model's ``global_params`` and
    ``global_state_dict_keys`` (built on a pipeline engine's own when it has them)."""
    from zeal.pipe.layout import stage_layout
    from zeal.zero import sharded_state as zss

    params = getattr(engine, "global_params", None)
    sd = getattr(engine, "global_state_dict_keys", None)
    if params is None or sd is None:
        with zss.sharded_state(engine, local=True) as st:
            params = st.params
        sd = stage_layout(params, engine.module, None, None)["sd"]
    engine.global_params, engine.global_state_dict_keys = global_layout(params, sd, engine.module)


def writes_buffer(engine: Any, name: str, prefixes: dict[str, int]) -> bool:
    """Whether this rank writes buffer ``name`` into its checkpoint file: an expert's
    buffer by the first of that expert's data-parallel copies (tp rank 0), any other by
    rank 0."""
    mesh = engine.mesh
    if mesh.ep_size > 1 and split_expert_name(name, prefixes) is not None:
        return mesh.edp_rank == 0 and mesh.tp_rank == 0
    return engine.rank == 0


def gather_experts(ep: Any, state: dict[str, torch.Tensor], module: nn.Module) -> dict[str, torch.Tensor]:
    """``state`` (this rank's state dict: its own experts) with every expert of every ep
    rank, all-gathered over ``ep`` tensor by tensor (collective: every ep rank calls it
    with the same structure; ep rank r's i-th local expert is expert r·E_local + i)."""
    prefixes = expert_prefixes(module)
    if not ep.active or not prefixes:
        return state
    gathered: dict[str, torch.Tensor] = {}
    device = ep.ctx.device  # the collective runs where the backend wants it
    for name, t in state.items():
        s = split_expert_name(name, prefixes)
        if s is None:
            continue
        p, g, rest = s
        n_local = prefixes[p] // ep.size
        every = torch.empty(ep.size * t.numel(), dtype=t.dtype, device=device)
        ep.all_gather(every, t.contiguous().view(-1).to(device), "param")
        for r, piece in enumerate(every.view(ep.size, *t.shape)):
            gathered[f"{p}.{r * n_local + g % n_local}.{rest}"] = piece.to(t.device).clone()
    return expand(state, prefixes, lambda _, new: gathered[new])
