"""One-line refusals for DeepSpeed names zeal does not implement.

:class:`Refused` is both ``NotImplementedError`` (what it means) and ``AttributeError``
(so ``hasattr(engine, name)`` is False and ``getattr(engine, name, default)`` works, as
libraries probing for features expect). Its message names the DeepSpeed API and, where
there is one, what to use in zeal instead. DeepSpeed's names themselves come from
``ds_0_19_8_names.json`` (see ``bench/compat/ds_surface.py``)."""

from __future__ import annotations

import dis
import functools
import json
import sys
from pathlib import Path
from typing import NoReturn


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


_IMPORT_FROM = {dis.opmap[n] for n in ("IMPORT_FROM", "IMPORT_NAME") if n in dis.opmap}


class RefusedName:
    """What ``from deepspeed.x import Name`` gives for a DeepSpeed name zeal does not
    implement: the import succeeds (scripts import such names at the top and use them only
    behind a flag), and any use — calling, instantiating, subclassing, an attribute,
    iterating — raises :class:`Refused`, one line naming the API and what to use instead."""

    def __init__(self, api: str, reason: str | None) -> None:
        object.__setattr__(self, "_api", api)
        object.__setattr__(self, "_reason", reason)

    def _refuse(self, *args: object, **kwargs: object) -> NoReturn:
        raise Refused(object.__getattribute__(self, "_api"), object.__getattribute__(self, "_reason"))

    __call__ = __iter__ = __len__ = __getitem__ = __enter__ = __setattr__ = _refuse

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        self._refuse()

    def __mro_entries__(self, bases: tuple) -> NoReturn:  # class X(RefusedThing): ...
        self._refuse()

    def __repr__(self) -> str:
        return f"<{object.__getattribute__(self, '_api')}: not supported by zeal>"


def importing_from(depth: int = 2) -> bool:
    """Whether the frame ``depth`` up is executing ``from module import name`` (the module's
    ``__getattr__`` was called by the import, not by an attribute access)."""
    frame = sys._getframe(depth)
    code = frame.f_code.co_code
    return 0 <= frame.f_lasti < len(code) and code[frame.f_lasti] in _IMPORT_FROM


def refuse(api: str, reason: str | None) -> RefusedName:
    """For a module ``__getattr__``: a :class:`RefusedName` when the name is being imported
    with ``from ... import``, else raise :class:`Refused` at the attribute (so ``hasattr``
    stays False for libraries that probe)."""
    if importing_from(3):
        return RefusedName(api, reason)
    raise Refused(api, reason)
