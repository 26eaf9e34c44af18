"""The opt-in switch: ``import deepspeed`` (and every ``deepspeed.*``) resolves to zeal.

:func:`install` puts one finder first on ``sys.meta_path``. For a module named
``deepspeed`` or ``deepspeed.<rest>`` it answers with ``zeal.deepspeed`` or
``zeal.deepspeed.<rest>`` — the same module object under both names, so
``deepspeed.comm is zeal.deepspeed.comm``. The same finder gives
``importlib.metadata`` a ``deepspeed`` distribution (version ``zeal.deepspeed.__version__``),
so libraries that detect DeepSpeed by package metadata (transformers, accelerate) find it.

Nothing happens unless a user asks for it: ``zeal deepspeed`` (the launcher),
``python -m zeal.deepspeed SCRIPT`` (for torchrun, ``accelerate launch``, SLURM), or
``ZEAL_DEEPSPEED=1`` with :func:`site_dir` on ``PYTHONPATH`` (a ``sitecustomize`` that
calls :func:`install`). A real DeepSpeed, if installed, is untouched otherwise.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
from pathlib import Path
from typing import Any

ENV = "ZEAL_DEEPSPEED"
_NAME = "deepspeed"
_TARGET = "zeal.deepspeed"


class _AliasLoader(importlib.abc.Loader):
    """Hands back the already-imported zeal module; nothing to execute."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return importlib.import_module(self.target)

    def exec_module(self, module: Any) -> None:
        return None


class _RefusedLoader(importlib.abc.Loader):
    """A DeepSpeed module zeal does not have (:mod:`zeal.deepspeed.refused_modules`)."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        from zeal.deepspeed.refused_modules import stand_in

        return stand_in(spec.name)

    def exec_module(self, module: Any) -> None:
        return None


class _Distribution(importlib.metadata.Distribution):
    """The ``deepspeed`` distribution as package metadata shows it (name, version)."""

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            from zeal.deepspeed import __version__

            return (f"Metadata-Version: 2.1\nName: {_NAME}\nVersion: {__version__}\n"
                    "Summary: DeepSpeed's API on zeal (zeal.deepspeed)\n")
        if filename == "top_level.txt":
            return f"{_NAME}\n"
        return None

    def locate_file(self, path: Any) -> Path:
        return Path(__file__).resolve().parent / str(path)


class DeepSpeedAlias(importlib.abc.MetaPathFinder):
    """``deepspeed[.x.y]`` → ``zeal.deepspeed[.x.y]``; the ``deepspeed`` distribution."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _NAME and not fullname.startswith(_NAME + "."):
            return None
        real = _TARGET + fullname[len(_NAME):]
        try:
            spec = importlib.util.find_spec(real)
        except ModuleNotFoundError:
            spec = None
        if spec is None:
            from zeal.deepspeed.refused_modules import is_deepspeed_module

            if is_deepspeed_module(fullname):  # a DeepSpeed module zeal lacks: importable, refused on use
                return importlib.machinery.ModuleSpec(fullname, _RefusedLoader(), is_package=True)
            return None  # the import fails as for any missing module, naming deepspeed.<rest>
        alias = importlib.machinery.ModuleSpec(fullname, _AliasLoader(real), origin=spec.origin,
                                               is_package=spec.submodule_search_locations is not None)
        if spec.submodule_search_locations is not None:
            alias.submodule_search_locations = list(spec.submodule_search_locations)
        return alias

    def find_distributions(self, context: Any = None) -> list[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is not None and name.replace("-", "_").lower() != _NAME:
            return []
        return [_Distribution()]


def installed() -> bool:
    """Whether the switch is on in this process."""
    return any(isinstance(f, DeepSpeedAlias) for f in sys.meta_path)


def install() -> None:
    """Turn the switch on in this process (idempotent). A real ``deepspeed`` imported
    before is dropped from ``sys.modules``, so later imports get zeal's."""
    if installed():
        return
    sys.meta_path.insert(0, DeepSpeedAlias())
    for name in [n for n in sys.modules if n == _NAME or n.startswith(_NAME + ".")]:
        mod = sys.modules[name]
        if not getattr(mod, "__name__", "").startswith(_TARGET):
            del sys.modules[name]


def uninstall() -> None:
    """Turn the switch off and forget the ``deepspeed`` aliases (for tests)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, DeepSpeedAlias)]
    for name in [n for n in sys.modules if n == _NAME or n.startswith(_NAME + ".")]:
        del sys.modules[name]


def site_dir() -> str:
    """The folder whose ``sitecustomize`` turns the switch on when ``ZEAL_DEEPSPEED=1``:
    put it first on ``PYTHONPATH`` for processes started by other launchers."""
    return str(Path(__file__).resolve().parent / "_site")
