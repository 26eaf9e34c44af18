"""Where every byte of parameters, gradients and optimizer state lives.

``register_external_parameter(module, param)`` (as in DeepSpeed) declares that a
module's forward reads a parameter another module owns; see :mod:`zeal.zero.external`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["register_external_parameter", "unregister_external_parameter"]


def __getattr__(name: str) -> Any:
    # lazy: zeal.zero.estimate (the planner) stays importable without torch
    if name in __all__:
        from zeal.zero import external

        return getattr(external, name)
    raise AttributeError(f"module 'zeal.zero' has no attribute {name!r}")
