"""``deepspeed.compression.helper``: the dotted-name attribute helpers scripts import
(DeepSpeed-Chat's LoRA code swaps submodules with them). The compression-layer
converters of DeepSpeed's helper are refused by name."""

from __future__ import annotations

from typing import Any

from zeal.deepspeed.refusals import refuse

__all__ = ["recursive_getattr", "recursive_setattr"]


def recursive_getattr(model: Any, module_name: str) -> Any:
    """``model.a.b.c`` for ``module_name = "a.b.c"``."""
    out = model
    for part in module_name.split("."):
        out = getattr(out, part)
    return out


def recursive_setattr(model: Any, module_name: str, module: Any) -> None:
    """Set ``model.a.b.c = module`` for ``module_name = "a.b.c"``."""
    parent, _, last = module_name.rpartition(".")
    setattr(recursive_getattr(model, parent) if parent else model, last, module)


def __getattr__(name: str) -> Any:
    if name.startswith("_"):
        raise AttributeError(name)
    return refuse(f"deepspeed.compression.helper.{name}", "zeal's compression is `zeal compress` / the config's "
                  "compression section")
