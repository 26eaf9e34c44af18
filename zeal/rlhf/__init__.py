"""RLHF on zeal: SFT, reward model, PPO (DeepSpeed-Chat's three steps), DPO and GRPO, with a
hybrid engine that trains under ``zeal.initialize`` and generates with zeal's serving engine.

The formulas are pure functions in :mod:`zeal.rlhf.formulas`; :func:`grpo`, :func:`dpo`,
:func:`ppo`, :func:`sft`, :func:`reward_model` and :func:`distill` (on-policy distillation) run whole
jobs (imported on first use).
"""

from __future__ import annotations

_LAZY = {
    "HybridEngine": "zeal.rlhf.hybrid",
    "RLHFConfig": "zeal.rlhf.config",
    "grpo": "zeal.rlhf.grpo_trainer",
    "distill": "zeal.rlhf.distillation",
    "dpo": "zeal.rlhf.offline_trainers",
    "ppo": "zeal.rlhf.ppo_trainer",
    "sft": "zeal.rlhf.offline_trainers",
    "reward_model": "zeal.rlhf.offline_trainers",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'zeal.rlhf' has no attribute {name!r}")
