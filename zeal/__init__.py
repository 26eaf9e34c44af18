"""zeal: ZeRO-family training and FastGen-style serving on PyTorch.

Public API: :func:`initialize`, :class:`Config`, :func:`load_config`, :class:`LLM`,
:class:`SamplingParams`, :func:`apply_process_settings`.

Importing zeal changes nothing in the process (no environment variable, thread count
or allocator setting) and loads neither the training nor the serving stack: each is
imported on first use. ``zeal train`` and ``zeal serve`` apply the process-wide
settings of their config (``process`` section) through :func:`apply_process_settings`;
a script that builds its own model calls it first thing to run as they do.
"""

from typing import Any

from zeal.config import Config, ConfigError, load_config

__all__ = ["LLM", "Config", "ConfigError", "SamplingParams", "TrainEngine", "apply_process_settings", "initialize",
           "load_config"]
__version__ = "0.1.0"

_LAZY = {
    "initialize": "zeal.train.build",
    "TrainEngine": "zeal.train.engine",
    "LLM": "zeal.inference",
    "SamplingParams": "zeal.inference",
    "apply_process_settings": "zeal.utils.process",
}


def __getattr__(name: str) -> Any:
    # Training and serving are imported on first use, so neither pays for the other.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'zeal' has no attribute {name!r}")
