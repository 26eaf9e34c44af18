"""DeepSpeed's API on zeal: ``deepspeed`` for scripts that run unchanged.

Two ways in. Under the switch (``zeal deepspeed script.py``, ``python -m zeal.deepspeed
script.py``, or ``ZEAL_DEEPSPEED=1``; :mod:`zeal.deepspeed.switch`) a script's own
``import deepspeed`` and every ``deepspeed.*`` import resolve here. Without it,
``import zeal.deepspeed as deepspeed`` does the same for one script::

    model_engine, optimizer, loader, lr_scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), config=ds_config)
    loss = model_engine(x); model_engine.backward(loss); model_engine.step()

What is here: :func:`initialize` (DeepSpeed's signature and 4-tuple), :func:`init_distributed`,
:func:`add_config_arguments`, ``comm``, ``accelerator.get_accelerator()``, ``utils``
(``RepeatingLoader``, ``logger``, ``log_dist``, ``groups``), ``runtime`` (``utils.set_random_seed``,
``lr_schedules``, ``zero``, ``pipe``), ``zero`` (``Init``, ``GatheredParameters``), ``pipe``
(``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec``), ``moe`` (``layer.MoE``, ``utils``),
``ops.adam`` (``FusedAdam``, ``DeepSpeedCPUAdam``), ``checkpointing`` and the engine
(:class:`DeepSpeedEngine`). A DeepSpeed name zeal does not implement raises one line
naming it and what to use instead. ``zeal.initialize`` stays the native entry point.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Iterable
from typing import Any

from zeal.deepspeed import (
    accelerator,
    checkpoint,
    checkpointing,
    comm,
    constants,
    git_version_info,
    git_version_info_installed,
    moe,
    ops,
    pipe,
    runtime,
    utils,
    zero,
)
from zeal.deepspeed.accelerator import get_accelerator
from zeal.deepspeed.comm.comm import init_distributed
from zeal.deepspeed.ds_config import as_deepspeed_reads
from zeal.deepspeed.engine import DeepSpeedEngine, PipelineEngine
from zeal.deepspeed.hybrid_engine import DeepSpeedHybridEngine, split_hybrid
from zeal.deepspeed.pipe import PipelineModule
from zeal.deepspeed.refusals import deepspeed_names, reason_by_prefix, refuse
from zeal.deepspeed.utils import OnDevice, log_dist, logger

__all__ = ["DeepSpeedEngine", "DeepSpeedHybridEngine", "OnDevice", "PipelineEngine", "PipelineModule", "accelerator",
           "add_config_arguments", "checkpoint", "checkpointing", "comm", "constants", "get_accelerator",
           "git_version_info", "git_version_info_installed", "init_distributed",
           "initialize", "log_dist", "logger", "moe",
           "ops", "pipe", "runtime", "utils", "zero"]
__version__ = "0.19.8+zeal"
version = __version__
__version_major__, __version_minor__, __version_patch__ = 0, 19, 8
git_hash = git_branch = __git_hash__ = __git_branch__ = None
TORCH_DISTRIBUTED_DEFAULT_PORT = constants.TORCH_DISTRIBUTED_DEFAULT_PORT
dist = comm
# the attention-projection kinds DeepSpeed's per-head Muon tags (its values; zeal has no Muon)
QUERY, KV, MLA_Q, MLA_KV, NOT_HEAD_BLOCKED = "query", "kv", "mla_q", "mla_kv", "not-head-blocked"

_REASONS = {
    "init_inference": "serve with zeal.LLM(...) / `zeal serve` (zeal's inference engine)",
    "default_inference_config": "zeal's inference config is zeal.config.InferenceConfig",
    "InferenceEngine": "serve with zeal.LLM(...) / `zeal serve`",
    "DeepSpeedInferenceConfig": "zeal's inference config is zeal.config.InferenceConfig",
    "inference": "serve with zeal.LLM(...) / `zeal serve`",
    "DeepSpeedTransformerLayer": "use zeal.models' blocks", "DeepSpeedTransformerConfig": "use zeal.models' blocks",
    "module_inject": "zeal applies tensor parallelism from the config (tensor_parallel.autotp_size)",
    "replace_transformer_layer": "zeal applies tensor parallelism from the config (tensor_parallel.autotp_size)",
    "set_autotp_mode": "set tensor_parallel.autotp_size in the config",
    "tp_model_init": "set tensor_parallel.autotp_size in the config",
    "record_tp_model_init_args": "set tensor_parallel.autotp_size in the config",
    "merge_tp_model_init_into_config": "set tensor_parallel.autotp_size in the config",
    "DualPipeVEngine": "zeal's pipeline schedules are 1f1b, gpipe and interleaved (pipeline_parallel.schedule)",
    "DualPipeVModule": "zeal's pipeline schedules are 1f1b, gpipe and interleaved (pipeline_parallel.schedule)",
    "autotuning": "`zeal estimate` picks a ZeRO stage for a memory budget",
    "profiling": "use torch.profiler", "compile": "call torch.compile on the model",
    "DeepSpeedConfig": "zeal.load_config(dict_or_path) validates a DeepSpeed config",
    "DeepSpeedOptimizer": "zeal's optimizers are torch.optim ones", "MUON_OPTIMIZER": "zeal has no Muon",
    "set_optimizer_flags": "zeal has no Muon", "resolve_per_head_muon_after_sharding": "zeal has no Muon",
    "DeepSpeedDataLoader": "pass training_data= to deepspeed.initialize",
    "launcher": "run scripts with `zeal deepspeed` (DeepSpeed's launcher flags)",
    "compression": "zeal's compression is `zeal compress` / the config's compression section",
    "nvme": "zeal's NVMe offload is zero_optimization.offload_*.device 'nvme'",
    "io": "zeal's NVMe offload is zero_optimization.offload_*.device 'nvme'",
    "sequence": "zeal has no sequence parallelism", "linear": "zeal has no DeepSpeed linear (LoRA) layers",
    "model_implementations": "use zeal.models", "datastates": "zeal checkpoints with zeal.checkpoint",
    "load_ds_config": "zeal.load_config(dict_or_path)", "DeepSpeedOptimizerCallable": "pass a callable taking "
    "parameters as optimizer=", "DeepSpeedSchedulerCallable": "pass a callable taking the optimizer as lr_scheduler=",
    "monitor": "zeal writes metrics to its run folder (engine.monitor is there, disabled)",
}


def __getattr__(name: str) -> Any:
    if name == "DeepSpeedConfigError":
        from zeal.config import ConfigError

        return ConfigError
    reason = reason_by_prefix(name, _REASONS)
    if reason is not None or name in deepspeed_names()["top_level"]:
        return refuse(f"deepspeed.{name}", reason)
    raise AttributeError(f"module 'deepspeed' has no attribute {name!r}")


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's command-line group to ``parser``: ``--deepspeed`` (flag),
    ``--deepspeed_config PATH`` and the deprecated ``--deepscale`` / ``--deepscale_config``;
    returns the parser."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (a flag for the script; no effect on the engine)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def initialize(args: Any = None, model: Any = None, optimizer: Any = None, model_parameters: Iterable[Any] | None = None,
               training_data: Any = None, lr_scheduler: Any = None, distributed_port: int = 29500, mpu: Any = None,
               dist_init_required: bool | None = None, collate_fn: Callable | None = None, config: Any = None,
               mesh_param: Any = None, config_params: Any = None) -> tuple[DeepSpeedEngine, Any, Any, Any]:
    """DeepSpeed's ``initialize``: ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    Joins the job first (:func:`init_distributed`, so torch.distributed is started at any
    world size). ``config`` is a dict or a JSON path (``args.deepspeed_config`` when not
    given, as in DeepSpeed); ``"auto"`` values are taken from the model and the client
    optimizer or name their key in a ConfigError. A :class:`PipelineModule` with no
    ``pipeline_parallel`` section in the config sets the pipeline size to its
    ``num_stages``. An enabled ``hybrid_engine`` section returns a
    :class:`DeepSpeedHybridEngine` (training plus ``generate``). zeal's tensor and pipeline
    parallelism come from the config (``tensor_parallel.autotp_size``, ``pipeline_parallel``):
    an ``mpu`` is accepted when it restates that layout (:mod:`zeal.deepspeed.mpu`, as
    DeepSpeed's AutoTP examples pass it), ``mesh_param`` is refused."""
    import zeal
    from zeal.pipe.module import PipelineModule as ZealPipelineModule

    if mesh_param is not None:
        raise ValueError("deepspeed.initialize: mesh_param is not supported by zeal; set "
                         "tensor_parallel.autotp_size / pipeline_parallel in the config instead")
    if model is None:
        raise ValueError("deepspeed.initialize: model is required")
    if config is None:
        config = config_params
    if config is None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is None:
        raise ValueError("deepspeed.initialize: no config (give config=, or --deepspeed_config through "
                         "deepspeed.add_config_arguments)")
    if isinstance(model, ZealPipelineModule):
        config = _with_pipeline_size(config, model.num_stages)
    if dist_init_required is not False:
        init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    if mpu is not None:
        from zeal.deepspeed.mpu import check_mpu
        from zeal.deepspeed.runtime.sequence_parallel.ulysses_sp import config_with_mpu

        config = config_with_mpu(_as_dict(config) or config, mpu)  # ALST's sp mpu carries the sp size
        check_mpu(mpu, _as_dict(config))
    os.environ.setdefault("MASTER_PORT", str(distributed_port))
    given = config  # what DeepSpeed's engine.config holds
    config, hybrid = split_hybrid(as_deepspeed_reads(config))
    engine = zeal.initialize(model, config, optimizer=optimizer, lr_scheduler=lr_scheduler,
                             training_data=training_data, model_parameters=model_parameters, collate_fn=collate_fn,
                             dist_init_required=dist_init_required)
    if hybrid is not None:
        ds: DeepSpeedEngine = DeepSpeedHybridEngine(engine, hybrid)
    else:
        ds = (PipelineEngine if hasattr(engine, "train_batch") else DeepSpeedEngine)(engine)
    ds.__dict__["_ds_config"] = _as_dict(given)
    if mpu is not None:
        from zeal.deepspeed.runtime.sequence_parallel.ulysses_sp import adopt

        adopt(engine, model)  # a model registered by UlyssesSPAttentionHF: DeepSpeed's chunk loss
    return ds, engine.optimizer, engine.dataloader, engine.lr_scheduler


def _with_pipeline_size(config: Any, num_stages: int) -> Any:
    """The config with ``pipeline_parallel.size = num_stages`` unless it sets a size."""
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    if not isinstance(config, dict):
        return config  # a zeal Config object says what it says
    section = dict(config.get("pipeline_parallel") or {})
    if "size" in section:
        if section["size"] != num_stages:
            raise ValueError(f"deepspeed.initialize: PipelineModule(num_stages={num_stages}) but the config's "
                             f"pipeline_parallel.size is {section['size']}")
        return config
    return {**config, "pipeline_parallel": {**section, "size": num_stages}}


def _as_dict(config: Any) -> dict | None:
    """A DeepSpeed config as a dict (a JSON path read); None for a zeal ``Config``."""
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            return json.load(f)
    return config if isinstance(config, dict) else None
