"""zeal: ZeRO-family training and FastGen-style serving on PyTorch.

Public API: :func:`initialize`, :class:`Config`, :func:`load_config`.
"""

import os

# Large CPU tensors on transparent huge pages: ZeRO-3 gathers and frees every unit twice
# per step and autograd allocates fresh gradients, so a training step touches gigabytes of
# new pages; with 2 MB pages a 124M-parameter stage-3 step ran in 2.9 s instead of 3.45 s
# at the same peak RSS (bench/README.md). torch reads the variable at its first large
# allocation, so it takes effect when zeal is imported before the model is built.
# Set THP_MEM_ALLOC_ENABLE=0 to opt out.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from zeal.config import Config, ConfigError, load_config  # noqa: E402
from zeal.train.build import initialize  # noqa: E402
from zeal.train.engine import TrainEngine  # noqa: E402

__all__ = ["LLM", "Config", "ConfigError", "SamplingParams", "TrainEngine", "initialize", "load_config"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The serving API is imported on first use, so training never pays for it.
    if name in ("LLM", "SamplingParams"):
        import zeal.inference as inference

        return getattr(inference, name)
    raise AttributeError(f"module 'zeal' has no attribute {name!r}")
