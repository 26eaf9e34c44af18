"""zeal: ZeRO-family training and FastGen-style serving on PyTorch.

Public API: :func:`initialize`, :class:`Config`, :func:`load_config`.
"""

from zeal.config import Config, ConfigError, load_config
from zeal.train.build import initialize
from zeal.train.engine import TrainEngine

__all__ = ["Config", "ConfigError", "TrainEngine", "initialize", "load_config"]
__version__ = "0.1.0"
