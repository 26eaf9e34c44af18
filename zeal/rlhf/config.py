"""An RLHF job's config file: a DeepSpeed JSON for the engine with the ``rlhf`` section
(:class:`~zeal.config.rlhf.RLHFConfig`, one typed tree shared by SFT, RM, PPO, DPO and
GRPO; re-exported here, where it lived) and DeepSpeed's ``hybrid_engine`` section."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from zeal.config import ConfigError
from zeal.config.rlhf import RLHFConfig  # the section lives in the config tree; re-exported here

DEFAULT_ENGINE = {
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0}},
    "zero_optimization": {"stage": 0},
    "gradient_clipping": 1.0,
}


def split_config(config: Any, defaults: dict | None = None) -> tuple[dict, RLHFConfig]:
    """``(engine config dict, RLHFConfig)`` from a dict, a JSON file path, or an
    :class:`RLHFConfig`; the dict's ``rlhf`` key is the RLHF section, every other key is
    the engine's (DeepSpeed names) over :data:`DEFAULT_ENGINE` and ``defaults``."""
    if isinstance(config, RLHFConfig):
        raw: dict = {"rlhf": config.model_dump()}
    elif config is None:
        raw = {}
    elif isinstance(config, (str, os.PathLike)):
        try:
            raw = json.loads(Path(config).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"config {config}: {e}") from None
    elif isinstance(config, dict):
        raw = dict(config)
    else:
        raise ConfigError(f"config must be a dict, a JSON path or an RLHFConfig, not {type(config).__name__}")
    section = raw.pop("rlhf", {}) or {}
    if isinstance(section, RLHFConfig):
        section = section.model_dump()
    try:
        rc = RLHFConfig(**{**(defaults or {}), **section})
    except ValidationError as e:
        err = e.errors()[0]
        raise ConfigError(f"rlhf.{'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    _hybrid_section(raw.pop("hybrid_engine", None), rc)
    engine = {**DEFAULT_ENGINE, **raw}
    return engine, rc


# DeepSpeed's hybrid_engine keys: what an RLHF job does with each (it always generates with the hybrid engine)
HYBRID_KEYS = {"enabled", "max_out_tokens", "inference_tp_size", "release_inference_cache", "pin_parameters",
               "tp_gather_partition_size"}


def _hybrid_section(section: Any, rc: RLHFConfig) -> None:
    """DeepSpeed's ``hybrid_engine`` section in an RLHF job: ``max_out_tokens`` sizes the
    answers (``max_new_tokens``); the KV cache is always released after generation and
    ZeRO-3 weights are always gathered one unit at a time, so ``release_inference_cache``,
    ``pin_parameters`` and ``tp_gather_partition_size`` change nothing; turning the engine
    off or tensor-parallel generation (``inference_tp_size`` > 1) are refused."""
    if section is None:
        return
    if not isinstance(section, dict):
        raise ConfigError("hybrid_engine must be an object")
    unknown = sorted(set(section) - HYBRID_KEYS)
    if unknown:
        raise ConfigError(f"hybrid_engine.{unknown[0]}: unknown key (known: {', '.join(sorted(HYBRID_KEYS))})")
    if section.get("enabled", True) is False:
        raise ConfigError("hybrid_engine.enabled: false is not supported: zeal's RLHF jobs always generate "
                          "with the hybrid engine")
    if int(section.get("inference_tp_size", 1)) != 1:
        raise ConfigError("hybrid_engine.inference_tp_size: tensor-parallel generation is not supported (use 1)")
    if "max_out_tokens" in section:
        rc.max_new_tokens = int(section["max_out_tokens"])
