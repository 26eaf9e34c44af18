"""The ``rlhf`` section of an RLHF job's config file (the rest is a DeepSpeed JSON for
the engine): one typed tree shared by SFT, RM, PPO, DPO and GRPO."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from zeal.config import ConfigError

DEFAULT_ENGINE = {
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0}},
    "zero_optimization": {"stage": 0},
    "gradient_clipping": 1.0,
}


class RLHFConfig(BaseModel):
    """Hyper-parameters of the RLHF jobs (DeepSpeed-Chat's and TRL's defaults where they exist)."""

    model_config = ConfigDict(extra="forbid")

    seed: int = Field(0, ge=0, lt=2**32, description="Seed of prompt order, sampling and initialisation "
                                                    "(0 <= seed < 2**32).")
    steps: int = Field(20, ge=1, description="Optimizer steps (PPO/GRPO: rollouts) to run.")
    batch_size: int = Field(4, ge=1, description="Prompts (or pairs, or conversations) per step per rank.")
    max_prompt_len: int = Field(128, ge=1, description="Prompts are cut to their last this-many tokens.")
    max_new_tokens: int = Field(32, ge=1, description="Answer length limit when generating.")
    max_seq_len: int = Field(256, ge=2, description="SFT/RM/DPO examples are cut to this many tokens.")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature of rollouts.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling of rollouts.")
    chat: bool = Field(True, description="Wrap text prompts as a user turn in the model's chat template.")
    # GRPO
    num_generations: int = Field(4, ge=1, description="GRPO: answers sampled per prompt (the group size G).")
    beta: float = Field(0.04, ge=0.0, description="GRPO: weight of the k3 KL to the reference; DPO: β "
                        "(see dpo_beta); 0 skips the reference model in GRPO.")
    clip: float = Field(0.2, gt=0.0, description="PPO/GRPO: ratio clip ε.")
    clip_high: float | None = Field(None, description="GRPO: upper clip (DAPO's ε_high); None: clip.")
    loss_type: Literal["sequence", "token"] = Field("sequence", description="GRPO: mean per answer then over "
                                                    "answers ('sequence'), or over all answer tokens ('token').")
    scale_rewards: bool = Field(True, description="GRPO: divide group advantages by the group's std.")
    ppo_epochs: int = Field(1, ge=1, description="PPO/GRPO: passes over each rollout batch.")
    share_prompt: bool = Field(True, description="GRPO: each prompt goes through the policy and the reference "
                               "once per group, its answers attending to its keys/values (zeal.rlhf.shared_prefix: "
                               "the same log-probs); off, or under ZeRO-3 or activation checkpointing: full rows.")
    # PPO (DeepSpeed-Chat's constants)
    kl_coef: float = Field(0.1, ge=0.0, description="PPO: β of the per-token KL penalty in the rewards.")
    clip_reward: float = Field(5.0, gt=0.0, description="PPO: the reward score is clipped to ±this.")
    clip_value: float = Field(0.2, gt=0.0, description="PPO: value clip around the old values.")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="PPO: discount γ of GAE.")
    lam: float = Field(0.95, ge=0.0, le=1.0, description="PPO: λ of GAE.")
    whiten_advantages: bool = Field(False, description="PPO: whiten advantages over the batch's answer tokens.")
    critic_lr: float = Field(5e-6, gt=0.0, description="PPO: the critic's learning rate.")
    ema: float | None = Field(None, description="PPO: β of an EMA of the actor's weights (e.g. 0.992; saved "
                              "with every checkpoint and restored on resume); None: off.")
    unsup_coef: float = Field(0.0, ge=0.0, description="PPO: weight of the unsupervised LM loss mixed in "
                              "(PPO-ptx; needs SFT-style data); 0: off.")
    # DPO / RM
    dpo_beta: float = Field(0.1, gt=0.0, description="DPO: β of the sigmoid loss.")
    eval_fraction: float = Field(0.2, ge=0.0, lt=1.0, description="RM: share of pairs held out for accuracy.")
    # running
    log_every: int = Field(1, ge=1, description="Console line every this many steps.")
    save_every: int = Field(0, ge=0, description="Checkpoint every this many steps (0: only at the end).")
    resume: bool = Field(True, description="Continue from <out>/checkpoints when one exists.")
    kv_cache_bytes: int = Field(256 << 20, ge=1 << 16, description="Hybrid engine: KV cache size while generating.")
    generation_dtype: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="Hybrid engine: dtype of the serving copy that generates rollouts. 'auto': bf16 for an "
        "fp32 actor where the device multiplies bf16 natively (zeal.utils.hardware.native_bf16), else the actor's "
        "dtype. With a bf16 copy of an fp32 actor, PPO/GRPO ratios and KL use the training side's fp32 log-probs.")


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
