"""The whole model's parameter layout, known on every pipeline stage.

Each stage holds only its own parameters, but a checkpoint describes the whole model
(so that it loads without pipeline stages, or with others): every stage contributes its
parameters' descriptions (:class:`~zeal.zero.sharded_state.ParamInfo`, in module order)
and its state-dict keys, gathered once over the pipeline group when the engine is
built. The last stage's copy of a tied head is not a parameter; its state-dict key
names the first stage's parameter, as a tied module's state dict does.
"""

from __future__ import annotations

import json

import torch

from zeal.dist.agree import gather_strings
from zeal.dist.comm import Comm
from zeal.zero.sharded_state import ParamInfo


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"not a dtype: {name!r}")
    return value


def stage_layout(params: dict[str, ParamInfo], module: torch.nn.Module, tied_alias: str | None,
                 tied_name: str | None) -> dict:
    """This stage's part: parameter descriptions and state-dict keys (JSON-ready)."""
    keys = set(module.state_dict(keep_vars=True).keys())
    first: dict[int, str] = {}
    for n, q in module.named_parameters():
        first.setdefault(id(q), n)
    sd = {n: ["param", first[id(q)]] for n, q in module.named_parameters(remove_duplicate=False) if n in keys}
    return {"params": [[i.name, list(i.shape), str(i.dtype), str(i.model_dtype), i.trainable, i.group]
                       for i in params.values()],
            "sd": sd, "tied_alias": tied_alias, "tied_name": tied_name}


def gather_layout(pp: Comm, mine: dict) -> tuple[dict[str, ParamInfo], dict[str, list]]:
    """Every stage's part, in stage order: the whole model's ParamInfos and state-dict keys."""
    text = json.dumps(mine)
    width = int(pp.all_reduce_scalar(float(len(text.encode())), "max"))
    parts = [json.loads(s) for s in gather_strings(pp, text, width=max(width, 1))]
    infos: dict[str, ParamInfo] = {}
    sd: dict[str, list] = {}
    tied_name = next((p["tied_name"] for p in parts if p["tied_name"]), None)
    for p in parts:
        for name, shape, dtype, model_dtype, trainable, group in p["params"]:
            infos[name] = ParamInfo(name, tuple(shape), _dtype(dtype), _dtype(model_dtype), trainable, group)
        sd.update(p["sd"])
        if p["tied_alias"] and tied_name:
            sd[p["tied_alias"]] = ["param", tied_name]
    return infos, sd
