"""DeepSpeed JSON → zeal config. The ONLY module that knows DeepSpeed-only spellings.

Most keys are shared (zeal's schema uses DeepSpeed's names). Every other key that
DeepSpeed 0.19 accepts falls in one of four tables here:

* ``ALIASES``: another spelling of a zeal key (``bfloat16`` → ``bf16``, the short names
  of DeepSpeed's stage-3 aliases, ``cpu_offload`` ...), translated;
* ``NO_EFFECT``: accepted, and said once in the log, because it only tunes DeepSpeed
  internals, logging, or a mechanism zeal does not need;
* ``UNSUPPORTED``: refused naming the missing feature when it asks for something
  (a section with ``enabled: false``, or a value that asks for nothing, passes);
* ``"auto"``: resolved as the Hugging Face integration resolves it
  (:func:`resolve_auto`), from the job's own values (:class:`AutoValues`).

Keys in none of them stay and meet the schema, which refuses them as unknown.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from zeal.config.ds_compression import translate_compression

# path -> (feature zeal lacks, values that ask for nothing and so pass silently)
UNSUPPORTED: dict[str, tuple[str, tuple]] = {
    "pipeline": ("pipeline parallelism through DeepSpeed's 'pipeline' section (zeal's key is 'pipeline_parallel')", ({},)),
    "data_efficiency.data_sampling.dynamic_batching": ("dynamic batching", ()),
    "progressive_layer_drop": ("progressive layer dropping", ()),
    "eigenvalue": ("the eigenvalue (Hessian) analysis", ()),
    "quantize_training": ("quantization-aware training (MoQ)", ()),
    "sparse_attention": ("sparse attention", ()),
    "elasticity": ("elastic training", ()),
    "autotuning": ("autotuning", ()),
    "amp": ("apex AMP (use bf16 or fp16)", ()),
    "torch_autocast": ("torch autocast mode (use bf16 or fp16)", ()),
    "hybrid_engine": ("the RLHF hybrid engine", ()),
    "nebula": ("the Nebula checkpoint service", ()),
    "moe": ("mixture of experts", ()),
    "expert_parallel": ("expert parallelism (AutoEP)", ()),
    "fp8": ("fp8 training", ()),
    "communication_data_type": ("a separate communication dtype", (None, "fp32")),
    "gradient_allreduce_op": ("summed gradients (gradient_allreduce_op 'sum')", ("mean",)),
    "managed_gradient_accumulation": ("unmanaged gradient accumulation", (True,)),
    "data_types.grad_accum_dtype": ("gradient accumulation in a 16-bit dtype", (None, "fp32")),
    "compile.deepcompile": ("DeepCompile", (False,)),
    "graph_harvesting": ("CUDA graph harvesting", (False,)),
    "checkpoint.use_node_local_storage": ("node-local checkpoint storage", (False,)),
    "fp16.fp16_master_weights_and_grads": ("fp16 master weights (zeal keeps fp32 masters)", (False,)),
    "bf16.bf16_master_weights_and_grads": ("bf16 master weights (zeal keeps fp32 masters)", (False,)),
    "bf16.bf16_optimizer_states": ("bf16 optimizer states (zeal keeps them in fp32)", (False,)),
    "zero_optimization.zeropp_loco_param": ("ZeRO++ LoCo", (None,)),
    "zero_optimization.mics_shard_size": ("MiCS", (-1,)),
    "zero_optimization.mics_hierarchical_params_gather": ("MiCS", (False,)),
    "zero_optimization.zenflow": ("ZenFlow", (None,)),
    "optimizer.params.bias_correction": ("Adam without bias correction", (True,)),
    "zero_optimization.zero_quantized_nontrainable_weights": ("quantized frozen weights (MixZ++)", (False,)),
    "zero_optimization.offload_optimizer.super_offload": ("SuperOffload", (False,)),
}

# Accepted and without effect in zeal: the reason is said once in the log.
NO_EFFECT: dict[str, str] = {
    "data_parallel_size": "zeal derives it: world size / (tensor × pipeline)",
    "zero_allow_untested_optimizer": "zeal runs any torch optimizer under every stage",
    "zero_force_ds_cpu_optimizer": "zeal picks its CPU optimizer itself",
    "memory_breakdown": "see engine.memory_breakdown()", "dump_state": "DeepSpeed-internal debugging",
    "gradient_predivide_factor": "zeal averages gradients in fp32", "prescale_gradients": "zeal averages in fp32",
    "sparse_gradients": "zeal reduces dense gradients", "disable_allgather": "DeepSpeed-internal",
    "tensorboard": "see the run folder's metrics", "wandb": "see the run folder's metrics",
    "csv_monitor": "see the run folder's metrics", "comet": "see the run folder's metrics",
    "monitor_config": "not a DeepSpeed key either", "comms_logger": "see engine.comm_stats()",
    "comms_config": "not a DeepSpeed key either", "timers": "see engine.wall_clock_breakdown()",
    "train_micro_batch_size_per_gpu_auto": "not a DeepSpeed key either",
    "use_data_before_expert_parallelism_": "zeal's MoE layers route each rank's own tokens (zeal.moe)",
    "seq_parallel_communication_data_type": "the Ulysses all-to-alls move the compute dtype",
    **{f"compile.{k}": "a DeepCompile option (DeepCompile itself is refused)" for k in (
        "autoep_non_moe", "free_activation", "free_activation_threshold", "offload_activation",
        "offload_activation_pin_memory", "offload_opt_states", "double_buffer", "symmetric_memory", "debug_log")},
    "tensor_parallel.tp_overlap_comm": "zeal's tensor-parallel all-reduces run in order",
    "tensor_parallel.tp_grain_size": "zeal splits attention by whole heads",
    "data_types": "gradients accumulate in fp32", "checkpoint.tag_validation": "zeal checks manifests instead",
    "checkpoint.load_universal": "every zeal checkpoint loads on any world size and stage",
    "checkpoint.parallel_write": "every rank writes its own shards", "checkpoint.writer": "DeepSpeed-internal",
    "aio.use_gds": "GPUDirect storage is not used", "aio.intra_op_parallelism": "DeepSpeed-internal",
    "fp16.auto_cast": "inputs are cast to the compute dtype", "bf16.auto_cast": "inputs are cast to the compute dtype",
    "bf16.immediate_grad_update": "DeepSpeed-internal", "bf16.check_grad_overflow": "bf16 needs no overflow check",
    "bf16.loss_scale": "bf16 needs no loss scaling", "bf16.initial_scale_power": "bf16 needs no loss scaling",
    "bf16.loss_scale_window": "bf16 needs no loss scaling", "bf16.hysteresis": "bf16 needs no loss scaling",
    "bf16.consecutive_hysteresis": "bf16 needs no loss scaling", "bf16.min_loss_scale": "bf16 needs no loss scaling",
    "optimizer.params.torch_adam": "zeal always uses torch's Adam",
    "optimizer.params.adam_w_mode": "read to pick Adam or AdamW",
    "optimizer.params.set_grad_none": "gradients are always dropped after a step",
    "optimizer.params.bias_correction": "torch's Adam always corrects the bias",
    "zero_optimization.round_robin_gradients": "DeepSpeed-internal copy order",
    "zero_optimization.load_from_fp32_weights": "zeal checkpoints always hold fp32 masters",
    "zero_optimization.elastic_checkpoint": "every zeal checkpoint loads on any world size",
    "zero_optimization.ignore_unused_parameters": "unused parameters are always allowed",
    "zero_optimization.cpu_offload_use_pin_memory": "see offload_optimizer.pin_memory",
    "zero_optimization.legacy_stage1": "DeepSpeed-internal",
    "zero_optimization.use_multi_rank_bucket_allreduce": "DeepSpeed-internal",
    "zero_optimization.memory_efficient_linear": "DeepSpeed-internal (stage 3 linear layers)",
    "zero_optimization.pipeline_loading_checkpoint": "DeepSpeed-internal",
    "zero_optimization.override_module_apply": "zeal does not patch Module.apply",
    "zero_optimization.log_trace_cache_warnings": "DeepSpeed-internal",
    "zero_optimization.enable_sanity_checks": "DeepSpeed-internal",
    "zero_optimization.leaf_module": "zeal gathers per module without leaf marks",
    "zero_optimization.save_muon_momentum_buffer_in_memory": "zeal has no Muon",
    "zero_optimization.stage3_model_persistence_threshold": "zeal bounds persistence per module",
    "zero_optimization.stage3_module_granularity_threshold": "zeal gathers whole units",
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": "zeal gathers with all-gather",
    "zero_optimization.stage3_allgather_sequential": "DeepSpeed-internal",
    "zero_optimization.offload_optimizer.pipeline_read": "DeepSpeed-internal",
    "zero_optimization.offload_optimizer.pipeline_write": "DeepSpeed-internal",
    "zero_optimization.offload_optimizer.pipeline": "DeepSpeed-internal",
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": "DeepSpeed-internal",
}

# DeepSpeed's other spellings of a key zeal has: old path -> zeal path
ALIASES: dict[str, str] = {
    "bfloat16": "bf16",
    "zero_optimization.prefetch_bucket_size": "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.param_persistence_threshold": "zero_optimization.stage3_param_persistence_threshold",
    "zero_optimization.model_persistence_threshold": "zero_optimization.stage3_model_persistence_threshold",
    "zero_optimization.max_live_parameters": "zero_optimization.stage3_max_live_parameters",
    "zero_optimization.max_reuse_distance": "zero_optimization.stage3_max_reuse_distance",
    "zero_optimization.gather_16bit_weights_on_model_save":
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save":
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.module_granularity_threshold": "zero_optimization.stage3_module_granularity_threshold",
    "zero_optimization.use_all_reduce_for_fetch_params": "zero_optimization.stage3_use_all_reduce_for_fetch_params",
}

ONE_BIT = {"onebitadam": "1-bit Adam", "zerooneadam": "0/1 Adam", "onebitlamb": "1-bit LAMB",
           "lamb": "the LAMB optimizer", "muon": "the Muon optimizer"}


@dataclass
class AutoValues:
    """The job's own values that DeepSpeed's ``"auto"`` entries take (Hugging Face's
    ``TrainingArguments`` in the HF integration). ``None`` = the job does not say.

    ``strict``: an ``"auto"`` that cannot be derived is an error naming the key; when
    false (reports that only read sizes, such as ``zeal estimate``), it is dropped."""

    micro_batch: int | None = None
    grad_accum: int | None = None
    lr: float | None = None
    betas: tuple[float, float] | None = None
    eps: float | None = None
    weight_decay: float | None = None
    gradient_clipping: float | None = None
    fp16: bool | None = None
    bf16: bool | None = None
    warmup_steps: int | None = None
    total_steps: int | None = None
    hidden_size: int | None = None
    strict: bool = True
    resolved: dict[str, Any] = field(default_factory=dict)  # filled: key path -> value taken


# Hugging Face's defaults (TrainingArguments' own defaults, or the constant it fills in)
# for the keys where a default is part of its semantics.
HF_DEFAULTS: dict[str, Any] = {
    "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "optimizer.params.betas": [0.9, 0.999],
    "optimizer.params.eps": 1e-8, "optimizer.params.weight_decay": 0.0, "scheduler.params.warmup_min_lr": 0.0,
    "scheduler.params.warmup_num_steps": 0, "fp16.enabled": False, "bf16.enabled": False, "amp.enabled": False,
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
}


def translate(raw: dict[str, Any], auto: AutoValues | None = None) -> tuple[dict[str, Any], list[str]]:
    """Return (zeal config dict, notes). Raises ValueError for unsupported keys and for an
    ``"auto"`` that cannot be derived (see :func:`resolve_auto`)."""
    cfg = copy.deepcopy(raw)
    notes: list[str] = []
    for k in [k for k in cfg if isinstance(k, str) and k.startswith("_")]:
        del cfg[k]  # "_comment" and friends: DeepSpeed ignores them
    for k in [k for k in cfg if isinstance(k, str) and "." in k]:  # TRL's prepare_deepspeed adds these
        del cfg[k]
        notes.append(f"'{k}' (a dotted top-level key) is ignored, as DeepSpeed ignores it: nest it in its section")
    _legacy_forms(cfg, notes)
    _aliases(cfg, notes)
    _sequence_parallel_section(cfg, notes)
    resolve_auto(cfg, auto or AutoValues(), notes)
    _optimizer(cfg)  # an unsupported optimizer is named before its parameters
    translate_compression(cfg, notes)
    _refuse_unsupported(cfg)
    for path, why in NO_EFFECT.items():
        node, leaf = _parent(cfg, path)
        if node is not None and leaf in node:
            del node[leaf]
            if path != "optimizer.params.adam_w_mode":
                notes.append(f"'{path}' is accepted for DeepSpeed compatibility and has no effect in zeal ({why})")
    return cfg, notes


def resolve_auto_in(raw: dict[str, Any], auto: AutoValues) -> tuple[dict[str, Any], list[str]]:
    """A copy of the DeepSpeed dict ``raw`` with aliases renamed and every ``"auto"``
    resolved (:func:`resolve_auto`); still a DeepSpeed config (what a run folder saves)."""
    cfg = copy.deepcopy(raw)
    notes: list[str] = []
    _legacy_forms(cfg, notes)
    _aliases(cfg, notes)
    resolve_auto(cfg, auto, notes)
    return cfg, notes


def _aliases(cfg: dict[str, Any], notes: list[str]) -> None:
    for old, new in ALIASES.items():
        node, leaf = _parent(cfg, old)
        if node is not None and leaf in node:
            value = node.pop(leaf)
            tnode, tleaf = _parent(cfg, new, create=True)
            if isinstance(value, dict) and isinstance(tnode.get(tleaf), dict):
                tnode[tleaf] = {**value, **tnode[tleaf]}  # the zeal spelling wins key by key
            else:
                tnode.setdefault(tleaf, value)
            notes.append(f"'{old}' is DeepSpeed's other spelling of '{new}'")


def _sequence_parallel_section(cfg: dict[str, Any], notes: list[str]) -> None:
    """LLaMA-Factory's ``"sequence_parallel": {"enabled", "size", "mode": "ulysses",
    "ulysses": {"degree"}}`` section (beside DeepSpeed's ``sequence_parallel_size``) →
    ``sequence_parallel_size``; another mode, or its tiling, is refused by name."""
    sec = cfg.get("sequence_parallel")
    if not isinstance(sec, dict):
        return
    del cfg["sequence_parallel"]
    if sec.get("enabled") is False:
        return
    if sec.get("mode", "ulysses") != "ulysses":
        raise ValueError(f"config key 'sequence_parallel.mode': zeal does not support sequence parallelism "
                         f"{sec['mode']!r} yet (only 'ulysses')")
    if isinstance(sec.get("tiling"), dict) and sec["tiling"].get("enabled"):
        raise ValueError("config key 'sequence_parallel.tiling': zeal does not support this section's "
                         "sequence parallelism tiling yet (its ALST tiling has keys of its own)")
    ulysses = sec.get("ulysses") if isinstance(sec.get("ulysses"), dict) else {}
    size = sec.get("size", ulysses.get("degree", 1))
    if cfg.setdefault("sequence_parallel_size", size) != size:
        raise ValueError(f"config key 'sequence_parallel.size' {size} disagrees with "
                         f"sequence_parallel_size {cfg['sequence_parallel_size']}")
    notes.append("'sequence_parallel' (LLaMA-Factory's section) is read as sequence_parallel_size "
                 f"{size}")


def _legacy_forms(cfg: dict[str, Any], notes: list[str]) -> None:
    if cfg.get("steps_per_print") == float("inf"):  # accelerate's "never print"
        cfg["steps_per_print"] = 2**62
    zero = cfg.get("zero_optimization")
    if isinstance(zero, bool):  # legacy form: "zero_optimization": true means stage 1
        cfg["zero_optimization"] = zero = {"stage": 1 if zero else 0}
    if not isinstance(zero, dict):
        return
    if zero.pop("cpu_offload", False):  # legacy stage-2 offload flag
        zero.setdefault("offload_optimizer", {"device": "cpu"})
    if zero.pop("cpu_offload_param", False):
        zero.setdefault("offload_param", {"device": "cpu"})
    zero.pop("cpu_offload_params", None)
    for key in ("offload_optimizer", "offload_param"):
        if zero.get(key) is None and key in zero:
            del zero[key]  # DeepSpeed's explicit null = no offload
    for key in ("reduce_bucket_size", "allgather_bucket_size"):
        if zero.get(key) == 0:  # DeepSpeed: no bucketing; zeal: a bucket per parameter
            zero[key] = 1
    if zero.get("sub_group_size") == 0:
        del zero["sub_group_size"]  # DeepSpeed: no sub-groups; zeal: one step per unit anyway
        notes.append("'zero_optimization.sub_group_size: 0' is accepted and has no effect in zeal")


def _refuse_unsupported(cfg: dict[str, Any]) -> None:
    for path, (what, passes) in UNSUPPORTED.items():
        node, leaf = _parent(cfg, path)
        if node is None or leaf not in node:
            continue
        value = node[leaf]
        off = (isinstance(value, dict) and (value.get("enabled") is False or value.get("disable") is True
                                            or (not value and {} in passes))) or _in(value, passes)
        if not off:
            raise ValueError(f"config key '{path}': zeal does not support {what} yet")
        del node[leaf]


def _in(value: Any, passes: tuple) -> bool:
    return any(type(value) is type(p) and value == p for p in passes) or (value is None and None in passes)


def _optimizer(cfg: dict[str, Any]) -> None:
    opt = cfg.get("optimizer")
    if not isinstance(opt, dict):
        return
    params = opt.setdefault("params", {})
    kind = str(opt.get("type", "")).lower()
    if kind in ONE_BIT:
        raise ValueError(f"config key 'optimizer.type': zeal does not support {ONE_BIT[kind]} "
                         f"({opt['type']}) yet; use Adam or AdamW")
    if kind in ("adam", "adamw", "fusedadam", "cpuadam", "deepspeedcpuadam"):
        # DeepSpeed's "Adam" is decoupled-weight-decay Adam unless adam_w_mode is false.
        adam_w = params.get("adam_w_mode", True) if kind != "adamw" else True
        opt["type"] = "AdamW" if adam_w else "Adam"
        if not params.get("torch_adam", False):
            # DeepSpeed's FusedAdam / CPU Adam default to no weight decay (torch's AdamW: 0.01)
            params.setdefault("weight_decay", 0.0)


def resolve_auto(cfg: dict[str, Any], auto: AutoValues, notes: list[str]) -> None:
    """Replace every ``"auto"`` in ``cfg`` (in place) as the Hugging Face integration
    does: batch sizes, clipping, precision and optimizer values from the job (``auto``);
    ``warmup_max_lr`` from the learning rate; bucket sizes from the model's hidden size
    (``h·h``, ``0.9·h·h`` and ``10·h``); ``train_batch_size`` from micro × accumulation
    × world (left to the batch arithmetic). What the job cannot give takes Hugging Face's
    default where it has one (``HF_DEFAULTS``); otherwise a ValueError names the key."""
    opt_lr = _get(cfg, "optimizer.params.lr")
    lr = auto.lr if auto.lr is not None else (opt_lr if isinstance(opt_lr, (int, float)) else None)
    h = auto.hidden_size
    betas = list(auto.betas) if auto.betas is not None else None
    derived: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": auto.micro_batch, "gradient_accumulation_steps": auto.grad_accum,
        "gradient_clipping": auto.gradient_clipping, "fp16.enabled": auto.fp16, "bf16.enabled": auto.bf16,
        "optimizer.params.lr": lr, "optimizer.params.betas": betas, "optimizer.params.eps": auto.eps,
        "optimizer.params.weight_decay": auto.weight_decay, "scheduler.params.warmup_max_lr": lr,
        "scheduler.params.warmup_num_steps": auto.warmup_steps, "scheduler.params.total_num_steps": auto.total_steps,
        "zero_optimization.reduce_bucket_size": h * h if h else None,
        "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * h * h) if h else None,
        "zero_optimization.stage3_param_persistence_threshold": 10 * h if h else None,
    }
    for path in list(_auto_paths(cfg)):
        node, leaf = _parent(cfg, path)
        if path in RUNTIME_AUTO:
            continue  # zeal's own "auto", chosen at run time from the tensors
        if path == "train_batch_size":
            del node[leaf]  # micro × accumulation × world, by the batch arithmetic
            continue
        value = derived.get(path)
        source = "the job"
        if value is None and path in _BATCH and isinstance(cfg.get("train_batch_size"), int):
            del node[leaf]  # train_batch_size gives it (DeepSpeed's batch arithmetic)
            continue
        if value is None and path in HF_DEFAULTS:
            value, source = HF_DEFAULTS[path], "Hugging Face's default"
        if value is None:
            if auto.strict:
                raise ValueError(f"config key '{path}' is \"auto\" and nothing here gives its value "
                                 f"({_AUTO_HINT.get(path.rsplit('.', 1)[-1], 'write a number')})")
            del node[leaf]
            continue
        node[leaf] = value
        auto.resolved[path] = value
        notes.append(f"\"auto\" resolved: {path} = {value} (from {source})")


# keys whose "auto" is a value of zeal's schema (resolved at run time), not Hugging Face's placeholder
RUNTIME_AUTO = frozenset({"tiling.tiled_mlp.num_shards", "tiling.tiled_logits_loss.num_shards"})
_BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_AUTO_HINT = {
    "train_micro_batch_size_per_gpu": "write it, or give train_batch_size",
    "lr": "write the learning rate", "warmup_max_lr": "write optimizer.params.lr or this value",
    "total_num_steps": "write the number of optimizer steps",
    "reduce_bucket_size": "the model has no hidden size to derive it from; write a number",
    "stage3_prefetch_bucket_size": "the model has no hidden size to derive it from; write a number",
    "stage3_param_persistence_threshold": "the model has no hidden size to derive it from; write a number",
}


def _auto_paths(node: Any, prefix: str = ""):
    if isinstance(node, dict):
        for k, v in list(node.items()):
            path = f"{prefix}{k}"
            if v == "auto":
                yield path
            else:
                yield from _auto_paths(v, path + ".")


def _get(cfg: dict[str, Any], path: str) -> Any:
    node, leaf = _parent(cfg, path)
    return None if node is None else node.get(leaf)


def _parent(cfg: dict[str, Any], path: str, create: bool = False) -> tuple[dict[str, Any] | None, str]:
    *heads, leaf = path.split(".")
    node: Any = cfg
    for h in heads:
        nxt = node.get(h) if isinstance(node, dict) else None
        if nxt is None and create and isinstance(node, dict):
            nxt = node[h] = {}
        node = nxt
        if node is None:
            return None, leaf
    return (node if isinstance(node, dict) else None), leaf
