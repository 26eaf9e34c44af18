"""Who talks to whom: the mesh builds every process group once and hands out accounted Comms.

The names below load on first use (PEP 562): a launcher process (``zeal launch``,
``zeal train --nproc N``) imports ``zeal.dist.launch``, which needs no torch, and so starts
without importing torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zeal.dist.comm import Comm, CommStats
    from zeal.dist.context import DistContext, init_distributed
    from zeal.dist.mesh import Mesh, build_mesh, layout

_HOME = {"Comm": "comm", "CommStats": "comm", "DistContext": "context", "init_distributed": "context",
         "Mesh": "mesh", "build_mesh": "mesh", "layout": "mesh"}

__all__ = ["Comm", "CommStats", "DistContext", "Mesh", "build_mesh", "init_distributed", "layout"]


def __getattr__(name: str):
    if name in _HOME:
        return getattr(importlib.import_module(f"zeal.dist.{_HOME[name]}"), name)
    raise AttributeError(f"module 'zeal.dist' has no attribute {name!r}")
