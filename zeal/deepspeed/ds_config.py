"""How DeepSpeed itself reads a config, where that differs from zeal's stricter reading:
applied by ``deepspeed.initialize`` only (zeal's own ``initialize`` keeps its errors).

- ``zero_optimization.offload_param`` below stage 3: DeepSpeed never reads it there (its
  stage 1/2 optimizer has no parameter offload) and DeepSpeed-Chat's ``--offload`` sets it
  at every stage; zeal's config refuses it, so the facade drops it, with a log line."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("zeal.deepspeed")


def as_deepspeed_reads(config: Any) -> Any:
    """``config`` (a dict; anything else is returned as it is) as DeepSpeed would read it."""
    if not isinstance(config, dict) or not isinstance(config.get("zero_optimization"), dict):
        return config
    zero = config["zero_optimization"]
    stage = zero.get("stage", 0)
    if "offload_param" in zero and isinstance(stage, int) and stage < 3:
        device = (zero["offload_param"] or {}).get("device", "none") if isinstance(zero["offload_param"], dict) else None
        if device not in (None, "none"):
            logger.info("zero_optimization.offload_param is ignored at stage %d, as DeepSpeed ignores it below stage 3",
                        stage)
        zero = {k: v for k, v in zero.items() if k != "offload_param"}
        return {**config, "zero_optimization": zero}
    return config
