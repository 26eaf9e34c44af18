"""``deepspeed.compression`` on zeal: only ``helper``'s attribute helpers
(``recursive_getattr`` / ``recursive_setattr``, which DeepSpeed-Chat's LoRA code imports).
DeepSpeed's compression API itself (``init_compression``, ``redundancy_clean``) is
refused by name: zeal's compression is ``zeal compress`` / the config's ``compression``
section."""

from __future__ import annotations

from typing import Any

from zeal.deepspeed.compression import helper
from zeal.deepspeed.refusals import refuse

__all__ = ["helper"]


def __getattr__(name: str) -> Any:
    if name.startswith("_"):
        raise AttributeError(name)
    return refuse(f"deepspeed.compression.{name}", "zeal's compression is `zeal compress` / the config's "
                  "compression section")
