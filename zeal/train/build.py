"""``zeal.initialize``: the ONE place that wires features into a plain model, in order.

The model stays a plain single-device ``nn.Module``; each feature is an apply-step, a
function in its own module that changes the model (or wraps its parameters) and
returns the parts it adds. ``initialize`` only calls them, in this order:

1. the model: a module (perhaps built under ``zeal.deepspeed.zero.Init``, on the meta
   device), or a factory called on the meta device; then the config, its ``"auto"``
   values taken from the model (hidden size) and the client optimizer (lr, betas, ...);
2. the mesh: torchrun's environment joined, every process group built once
   (:mod:`zeal.dist.mesh`); batch arithmetic resolved against the data-parallel size;
3. ``apply_precision``: the compute dtype, buffers cast to it, the fp16 loss scaler;
4. ``apply_activation_checkpointing``: what the forward saves for backward;
5. ``apply_token_drop``: random-LTD on the layers the config names (:mod:`zeal.data.random_ltd`);
   ``apply_compression``: QAT linears swapped in, N:M targets chosen (its step hooks, built
   over the ZeRO masters, come after the engine); ``apply_tensor_parallel``: attention and
   MLP linears split over ``mesh.tp`` (:mod:`zeal.parallel.tensor`); ``apply_moe``: each MoE
   layer keeps this rank's experts and takes ``mesh.ep`` (the mesh's ep size is the model's
   MoE ``ep_size``); ``apply_tiling``: dense MLPs wrapped in TiledMLP, the tiled loss on
   (:mod:`zeal.train.tiling`) — each changes the modules before ZeRO flattens their parameters;
   ``apply_sequence_parallel``: attention through Ulysses all-to-alls over ``mesh.sp``
   (:mod:`zeal.parallel.sequence`), the engine then shards each batch over the sp group;
6. ``apply_zero(mesh.dp)``: parameters into flat units partitioned over the
   data-parallel Comm (MoE's expert parameters over ``mesh.edp``, handed in as a
   CommGroup), gradient reduction and (stage 3) the gather coordinator — it returns step
   hooks the engine runs around backward and step;
7. ``apply_offload``: the optimizer over fp32 masters, on the device, the CPU or NVMe
   (with tensor parallelism's grad-norm object);

then the LR schedule and the data loader (sharded over the data-parallel ranks).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from zeal.compression.apply import apply_compression
from zeal.config import AutoValues, Config, ConfigError, load_config
from zeal.data.curriculum_sampler import sampler_from_config
from zeal.data.random_ltd import apply_token_drop
from zeal.data.sampler import ResumableDistributedSampler
from zeal.dist.context import init_distributed
from zeal.dist.mesh import Mesh, build_mesh
from zeal.lora.engine import lora_step, lora_tp_step
from zeal.moe.apply import apply_moe, model_ep_size
from zeal.moe.layout import set_global_layout
from zeal.moe.tensor import moe_tensor_parallel
from zeal.moe.zero import expert_comm_group
from zeal.parallel.norm import TPGradNorm
from zeal.parallel.rng import apply_rng_regions
from zeal.parallel.sequence import apply_sequence_parallel
from zeal.parallel.tensor import apply_tensor_parallel, init_full_then_slice
from zeal.parallel.vocab import apply_vocab_parallel
from zeal.pipe.apply import apply_pipeline
from zeal.pipe.engine import PipelineEngine
from zeal.precision.apply import apply_precision
from zeal.train.activation_checkpointing import apply_activation_checkpointing
from zeal.train.compile import apply_compile
from zeal.train.engine import EngineParts, TrainEngine
from zeal.train.flops_profiler import FlopsProfiler
from zeal.train.lr_schedules import build_scheduler
from zeal.train.tiling import apply_tiling, attach_to_zero, tiled_loss_runner
from zeal.utils.meta import meta_device
from zeal.utils.process import set_malloc_thresholds
from zeal.zero.apply import apply_zero
from zeal.zero.offload.apply import apply_offload
from zeal.zero.stages import resolve_stage
from zeal.zero.units import default_init_fn

log = logging.getLogger("zeal")


def initialize(
    model: nn.Module | Callable[[], nn.Module],
    config: Config | dict | str | os.PathLike | None = None,
    optimizer: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None = None,
    lr_scheduler: Any = None,
    training_data: torch.utils.data.Dataset | None = None,
    init_fn: Callable[[nn.Module], None] | None = None,
    *,
    model_parameters: Iterable[Any] | None = None,
    collate_fn: Callable[[list], Any] | None = None,
    dist_init_required: bool | None = None,
    config_params: Config | dict | str | os.PathLike | None = None,
) -> TrainEngine:
    """Wrap ``model`` for training under the given config; see :class:`TrainEngine`.

    The keywords are DeepSpeed's (``zeal.deepspeed.initialize`` returns its 4-tuple).
    ``model`` may be a factory (called under ``torch.device("meta")``) or a module built
    on the meta device (``zeal.deepspeed.zero.Init``): its parameters are then
    materialised unit by unit with ``init_fn`` (default: the model's ``_init_weights``
    or each module's ``reset_parameters``). ``optimizer`` may be an instance built over
    the model's parameters (its param groups and hyper-parameters are kept and its
    parameters replaced by zeal's masters, so an ``lr_scheduler`` built on it keeps
    working), or a callable taking param groups; without it the config's optimizer runs
    over ``model_parameters`` (parameters or param-group dicts, whose options are kept;
    default: every trainable parameter). ``config_params`` is DeepSpeed's older name of
    ``config``; ``dist_init_required`` is accepted (zeal joins torchrun's job whenever
    its environment is set). ``"auto"`` config values are taken from the model and the
    client optimizer, or are a :class:`ConfigError` naming the key.
    """
    del dist_init_required  # joining the job is decided by torchrun's environment
    model = _instantiate(model)
    cfg = load_config(config if config is not None else config_params, _auto_values(model, optimizer))
    mesh = _mesh(cfg, model_ep_size(model))
    try:
        _, micro, accum = cfg.resolve_batch(mesh.data_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    lora = lora_step(model, cfg)  # adapters on the plain model, the base frozen (zeal.lora), before any split
    stage = apply_pipeline(model, cfg, mesh, accum)  # this rank's pipeline stage (None without one)
    init = init_fn or default_init_fn(model)
    client_groups = _client_groups(model_parameters) if optimizer is None and model_parameters is not None else None
    groups, group_of = _param_groups(model, optimizer if client_groups is None else client_groups)

    # The order of the apply-steps, and the only place that knows it:
    precision = apply_precision(model, cfg, mesh.device, init)
    if precision.dtype == torch.float16 and mesh.device.type == "cpu" and mesh.rank == 0:
        log.warning(FP16_ON_CPU)
    apply_activation_checkpointing(model, cfg.activation_checkpointing)
    token_drop = _token_drop(model, cfg, mesh.data_size)
    compression = apply_compression(model, cfg.compression)
    tp = apply_tensor_parallel(model, cfg.tensor_parallel.autotp_size, mesh, (moe_tensor_parallel,))
    lora_tp_step(model, lora, tp)  # adapters split with their base linears
    if tp is not None:  # embedding and head split by vocabulary rows where T divides V (per pipeline stage)
        apply_vocab_parallel(model, tp, stage)
    if tp is not None:  # random ops inside split pairs draw from a per-tp-rank (and per-pp-stage) stream
        apply_rng_regions(model, tp, cfg.seed, pp_rank=mesh.pp_rank)
    if tp is not None and any(p.is_meta for p in model.parameters()):
        init = init_full_then_slice(init, model, tp)
    sp = _sequence_parallel(model, mesh, stage)  # after tp: Ulysses splits each tp rank's heads
    dropped = apply_moe(model, mesh)  # this rank's experts; the others leave the optimizer groups
    tiled = apply_tiling(model, cfg.tiling)  # ALST: dense MLPs over sequence tiles, the tiled logits loss
    sp = tiled_loss_runner(model, cfg.tiling, sp)  # HF causal LMs and sp chunks: the loss over tiles too
    groups = [[p for p in g if id(p) not in dropped] for g in groups]
    experts = expert_comm_group(model, mesh)  # MoE: expert parameters live over the expert-data group
    zero = apply_zero(model, cfg.zero_optimization, mesh, precision.dtype, groups, group_of, init, cfg.seed,
                      comm_groups=[experts] if experts is not None else None)
    attach_to_zero(tiled, zero.coordinator, model, sp)  # stage 3: a TiledMLP's MLP, the tiled loss's head: once
    apply_compile(model, cfg.compile)  # last: each block's forward as the steps above left it
    mesh.stats.total.clear()  # the layout's broadcasts are not training traffic
    # tensor parallelism: split parameters' squared gradient norms are summed over tp
    grad_norm = TPGradNorm(tp, [u for u in zero.units if u.trainable], zero.stage) if tp is not None else None
    zopt = apply_offload(cfg, zero, mesh, optimizer, precision.scaler, grad_norm)
    for group, options in zip(zopt.optimizer.param_groups, client_groups.param_groups if client_groups else []):
        group.update({k: v for k, v in options.items() if k != "params"})  # per-group lr, weight decay ...

    scheduler = _scheduler(cfg, lr_scheduler, zopt.optimizer)
    loader = _loader(cfg, training_data, micro, mesh, accum, collate_fn) if training_data is not None else None
    mesh.stats.step.clear()
    parts = EngineParts(model, cfg, mesh, zero.units, zero.reducer, zopt, zero.coordinator,
                        precision.scaler, scheduler, loader, precision.dtype, micro, accum, tp, zero.comm_groups, sp,
                        lora, token_drop)
    engine = TrainEngine(parts) if stage is None else PipelineEngine(parts, stage, cfg.pipeline_parallel.schedule)
    for hook in zero.hooks:
        engine.register_step_hook(hook)
    if token_drop is not None:  # random-LTD's schedule steps with the engine
        engine.register_step_hook(token_drop)
    for hook in compression.step_hooks(zopt, mesh.dp):
        engine.register_step_hook(hook)
    if cfg.flops_profiler.enabled:  # its figures: the hook's .result, and the report
        engine.register_step_hook(FlopsProfiler(model, cfg.flops_profiler, mesh.rank))
    if mesh.ep_size > 1:  # checkpoints describe every expert, not only this rank's
        set_global_layout(engine)
    return engine


def _loader(cfg: Config, training_data: Any, micro: int, mesh: Mesh, accum: int, collate_fn: Any) -> Any:
    """DeepSpeed's batches: DistributedSampler's order with its seed (0) unless the config sets one."""
    sampler = _curriculum_sampler(cfg, len(training_data), micro, mesh, accum) or ResumableDistributedSampler(
        len(training_data), mesh.data_size, mesh.data_rank, seed=cfg.seed if "seed" in cfg.model_fields_set else 0,
        batch_size=micro, drop_last=cfg.dataloader_drop_last)
    loader = torch.utils.data.DataLoader(training_data, batch_size=micro, sampler=sampler,
                                         drop_last=cfg.dataloader_drop_last, collate_fn=collate_fn)
    loader.data_sampler = sampler  # DeepSpeed's name (scripts call data_sampler.set_epoch)
    return loader


def _curriculum_sampler(cfg: Config, n: int, micro: int, mesh: Mesh, accum: int) -> Any:
    try:
        return sampler_from_config(cfg, n, micro, mesh.data_size, mesh.data_rank, accum)
    except (ValueError, OSError) as e:
        raise ConfigError(f"data_efficiency.data_sampling.curriculum_learning: {e}") from None


def _token_drop(model: nn.Module, cfg: Config, dp_size: int) -> Any:
    try:
        return apply_token_drop(model, cfg, dp_size)  # consumed layer-tokens count every data-parallel rank's
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _mesh(cfg: Config, ep: int = 1) -> Mesh:
    """Join the job (torchrun's environment) and build every group once. ZeRO++'s node
    groups are built only when a ZeRO++ option is on."""
    try:
        ctx = init_distributed(cfg.dist_backend, cfg.local_world_size, cfg.comm_timeout_s)
    except ValueError as e:  # a local_world_size that does not divide the world
        raise ConfigError(f"config key 'local_world_size': {e}") from None
    if ctx.device.type == "cpu" and ctx.world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.local_world_size))
    zc = cfg.zero_optimization
    zeropp = zc.zero_quantized_weights or zc.zero_quantized_gradients or zc.zero_hpz_partition_size > 1
    try:
        mesh = build_mesh(ctx, tp=max(cfg.tensor_parallel.autotp_size, 1), pp=cfg.pipeline_parallel.size, ep=ep,
                          hpz=zc.zero_hpz_partition_size if zeropp and ctx.world_size > 1 else None,
                          sp=cfg.sequence_parallel_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if resolve_stage(zc.stage).partitions_params or "nvme" in (zc.offload_param.device, zc.offload_optimizer.device):
        # Stage 3 and the disk tier exist to bound memory; on CPU their per-step gather and
        # gradient buffers (tens of MB, below glibc's dynamic mmap threshold) would otherwise
        # stay resident as freed-but-kept heap: every block of 1 MB or more gets its own mmap.
        set_malloc_thresholds(1 << 20)
    return mesh


def _sequence_parallel(model: nn.Module, mesh: Mesh, stage: Any) -> Any:
    try:
        return apply_sequence_parallel(model, mesh, stage)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _instantiate(model: nn.Module | Callable[[], nn.Module]) -> nn.Module:
    """A module as it is; a factory called on the meta device (materialised by ZeRO)."""
    if isinstance(model, nn.Module):
        return model
    if not callable(model):
        raise TypeError(f"model must be an nn.Module or a factory, got {type(model).__name__}")
    with meta_device():
        return model()


FP16_ON_CPU = ("fp16 is emulated on CPU, about 20x slower than bf16 (a small GPT: 802 vs 16.1k tokens/s; a "
               "matmul-heavy MLP step: 90 vs 4.7 ms); set bf16.enabled instead of fp16.enabled")


def _auto_values(model: nn.Module, optimizer: Any) -> AutoValues:
    """What ``"auto"`` can take from the job itself: the model's hidden size (for the
    bucket sizes) and the client optimizer's hyper-parameters."""
    cfg = getattr(model, "config", None)
    hidden = None
    for name in ("hidden_size", "n_embd", "d_model"):
        hidden = hidden or getattr(cfg, name, None)
    if hidden is None and isinstance(getattr(cfg, "hidden_sizes", None), (list, tuple)):
        hidden = max(cfg.hidden_sizes)  # what Hugging Face's integration reads as well
    auto = AutoValues(hidden_size=int(hidden) if isinstance(hidden, int) else None)
    if isinstance(optimizer, torch.optim.Optimizer):
        g = optimizer.param_groups[0]
        auto.lr = float(g["lr"]) if "lr" in g else None
        auto.betas = tuple(g["betas"]) if "betas" in g else None
        auto.eps, auto.weight_decay = g.get("eps"), g.get("weight_decay")
    return auto


class _ClientGroups:
    """``model_parameters`` seen as an optimizer's param groups (for ``_param_groups``)."""

    def __init__(self, groups: list[dict]) -> None:
        self.param_groups = groups


def _client_groups(model_parameters: Iterable[Any]) -> _ClientGroups:
    """DeepSpeed's ``model_parameters``: parameters, or param-group dicts."""
    items = list(model_parameters)
    if items and all(isinstance(g, dict) for g in items):
        return _ClientGroups([{**g, "params": list(g["params"])} for g in items])
    return _ClientGroups([{"params": items}])


def _param_groups(model: nn.Module, optimizer: Any) -> tuple[list[list[nn.Parameter]], dict[int, int]]:
    """Trainable parameters grouped as the client optimizer groups them (one group otherwise)."""
    seen: set[int] = set()
    params = []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    if isinstance(optimizer, (torch.optim.Optimizer, _ClientGroups)):
        group_of = {}
        for gi, g in enumerate(optimizer.param_groups):
            for p in g["params"]:
                group_of[id(p)] = gi
        missing = [p for p in params if p.requires_grad and id(p) not in group_of]
        if missing:
            raise ValueError(f"{len(missing)} trainable parameters of the model are not in the optimizer "
                             "(or in model_parameters)")
        groups = [[p for p in params if group_of.get(id(p)) == gi] for gi in range(len(optimizer.param_groups))]
        return groups, group_of
    return [params], {id(p): 0 for p in params}


def _scheduler(cfg: Config, lr_scheduler: Any, inner: torch.optim.Optimizer) -> Any:
    if lr_scheduler is not None:
        if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            return lr_scheduler(inner)
        return lr_scheduler
    if cfg.scheduler is None:
        return None
    try:
        return build_scheduler(cfg.scheduler.type, dict(cfg.scheduler.params), inner)
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None
