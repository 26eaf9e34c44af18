"""One-line refusals for DeepSpeed names zeal does not implement.

:class:`Refused` is both ``NotImplementedError`` (what it means) and ``AttributeError``
(so ``hasattr(engine, name)`` is False and ``getattr(engine, name, default)`` works, as
libraries probing for features expect). Its message names the DeepSpeed API and, where
there is one, what to use in zeal instead. DeepSpeed's names themselves come from
``ds_0_19_8_names.json`` (see ``bench/compat/ds_surface.py``)."""

from __future__ import annotations

import functools
import json
from pathlib import Path


class Refused(NotImplementedError, AttributeError):
    """A DeepSpeed API zeal does not implement; ``generic``: no alternative is named."""

    def __init__(self, api: str, reason: str | None = None) -> None:
        self.generic = reason is None
        text = reason or "not implemented by zeal"
        super().__init__(f"{api} (DeepSpeed 0.19) is not supported by zeal: {text}")


@functools.cache
def deepspeed_names() -> dict[str, frozenset[str]]:
    """DeepSpeed 0.19.8's public names: ``top_level``, ``engine``, ``engine_from_nn_module``."""
    raw = json.loads((Path(__file__).resolve().parent / "ds_0_19_8_names.json").read_text())
    return {k: frozenset(v) for k, v in raw.items() if isinstance(v, list)}


def reason_by_prefix(name: str, table: dict[str, str]) -> str | None:
    """The reason of the longest ``table`` key that ``name`` starts with (keys ending in
    ``*``) or equals."""
    if name in table:
        return table[name]
    best = max((k for k in table if k.endswith("*") and name.startswith(k[:-1])), key=len, default=None)
    return table[best] if best else None
