"""DeepSpeed JSON → zeal config. The ONLY module that knows DeepSpeed-only spellings.

Most keys are shared (zeal's schema uses DeepSpeed's names). Here we translate
legacy forms, resolve ``"auto"`` where the value is derivable, and refuse keys
that zeal knows but does not implement, so that nothing is silently ignored.
"""

from __future__ import annotations

import copy
from typing import Any

# Keys DeepSpeed accepts that zeal recognises but does not implement: refused with a message.
UNSUPPORTED: dict[str, str] = {
    "pipeline": "pipeline parallelism",
    "flops_profiler": "the FLOPs profiler",
    "compression_training": "the compression library",
    "data_efficiency": "the data-efficiency library",
    "curriculum_learning": "curriculum learning",
    "sparse_attention": "sparse attention",
    "elasticity": "elastic training",
    "autotuning": "autotuning",
    "amp": "apex AMP (use bf16 or fp16)",
    "hybrid_engine": "the RLHF hybrid engine",
    "moe": "mixture of experts",
    "communication_data_type": "a separate communication dtype",
    "zero_optimization.zeropp_loco_param": "ZeRO++ LoCo",
    "zero_optimization.mics_shard_size": "MiCS",
}

# Accepted for compatibility and ignored because they only affect DeepSpeed internals or logging.
HARMLESS: set[str] = {
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "memory_breakdown",
    "gradient_predivide_factor", "prescale_gradients", "sparse_gradients", "dump_state",
    "tensorboard", "wandb", "csv_monitor", "comms_logger", "train_micro_batch_size_per_gpu_auto",
    "zero_optimization.round_robin_gradients", "zero_optimization.load_from_fp32_weights",
    "zero_optimization.elastic_checkpoint", "zero_optimization.ignore_unused_parameters",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save", "zero_optimization.cpu_offload_use_pin_memory",
    "fp16.auto_cast", "bf16.immediate_grad_update", "bf16.check_grad_overflow",
}

_AUTO_DEFAULTS = {"reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                  "stage3_param_persistence_threshold", "stage3_max_live_parameters",
                  "stage3_max_reuse_distance", "sub_group_size"}


def translate(raw: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Return (zeal config dict, notes). Raises ValueError for unsupported keys."""
    cfg = copy.deepcopy(raw)
    notes: list[str] = []
    for path, what in UNSUPPORTED.items():
        node, leaf = _parent(cfg, path)
        if node is not None and leaf in node:
            value = node[leaf]
            if isinstance(value, dict) and value.get("enabled") is False:
                del node[leaf]
                continue
            raise ValueError(f"config key '{path}': zeal does not support {what} yet")
    for path in HARMLESS:
        node, leaf = _parent(cfg, path)
        if node is not None and leaf in node:
            del node[leaf]
            notes.append(f"'{path}' is accepted for DeepSpeed compatibility and has no effect in zeal")

    fp16 = cfg.get("fp16")
    if isinstance(fp16, dict) and "fp16_master_weights_and_grads" in fp16:
        raise ValueError("config key 'fp16.fp16_master_weights_and_grads': zeal always keeps fp32 master weights")
    if isinstance(cfg.get("bf16"), dict):
        cfg["bf16"].pop("auto_cast", None)

    zero = cfg.get("zero_optimization")
    if isinstance(zero, bool):  # legacy form: "zero_optimization": true means stage 1
        cfg["zero_optimization"] = zero = {"stage": 1 if zero else 0}
    if isinstance(zero, dict):
        if zero.pop("cpu_offload", False):  # legacy stage-2 offload flag
            zero.setdefault("offload_optimizer", {"device": "cpu"})
        if zero.pop("cpu_offload_params", False):
            zero.setdefault("offload_param", {"device": "cpu"})
        for key in list(zero):
            if zero[key] == "auto" and key in _AUTO_DEFAULTS:
                del zero[key]
        for key in ("offload_optimizer", "offload_param"):
            if isinstance(zero.get(key), dict):
                zero[key].pop("pipeline_read", None)
                zero[key].pop("pipeline_write", None)
                zero[key].pop("pipeline", None)

    if cfg.get("gradient_clipping") == "auto":
        cfg["gradient_clipping"] = 0.0
    opt = cfg.get("optimizer")
    if isinstance(opt, dict):
        params = opt.setdefault("params", {})
        for k in [k for k, v in params.items() if v == "auto"]:
            del params[k]
        # DeepSpeed's "Adam" is decoupled-weight-decay Adam unless adam_w_mode is false.
        if str(opt.get("type", "")).lower() == "adam":
            adam_w = params.pop("adam_w_mode", True)
            params.pop("torch_adam", None)
            opt["type"] = "AdamW" if adam_w else "Adam"
        elif str(opt.get("type", "")).lower() == "adamw":
            params.pop("adam_w_mode", None)
            params.pop("torch_adam", None)
            opt["type"] = "AdamW"
    sch = cfg.get("scheduler")
    if isinstance(sch, dict):
        params = sch.setdefault("params", {})
        for k in [k for k, v in params.items() if v == "auto"]:
            del params[k]
    return cfg, notes


def _parent(cfg: dict[str, Any], path: str) -> tuple[dict[str, Any] | None, str]:
    *heads, leaf = path.split(".")
    node: Any = cfg
    for h in heads:
        node = node.get(h) if isinstance(node, dict) else None
        if node is None:
            return None, leaf
    return (node if isinstance(node, dict) else None), leaf
