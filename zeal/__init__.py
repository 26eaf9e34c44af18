"""zeal: ZeRO-family training and FastGen-style serving on PyTorch.

Public API: :func:`initialize`, :class:`Config`, :func:`load_config`.
"""

from zeal.config import Config, ConfigError, load_config
from zeal.train.build import initialize
from zeal.train.engine import TrainEngine

__all__ = ["LLM", "Config", "ConfigError", "SamplingParams", "TrainEngine", "initialize", "load_config"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The serving API is imported on first use, so training never pays for it.
    if name in ("LLM", "SamplingParams"):
        import zeal.inference as inference

        return getattr(inference, name)
    raise AttributeError(f"module 'zeal' has no attribute {name!r}")
