"""``zeal.initialize``: the ONE place that wires features into a plain model, in order.

1. config → validated tree; distributed context from torchrun's environment;
   batch arithmetic resolved against the world size.
2. the model: a module, or a factory called on the meta device.
3. precision: the compute dtype (bf16/fp16/fp32); buffers cast to it.
4. ZeRO layout: trainable parameters moved into flat units (buckets for stages
   0–2, one per module for stage 3), values made identical on every rank
   (broadcast from rank 0, or deterministic per-unit materialisation of meta
   parameters, so no rank ever holds the whole model in stage 3).
5. gradient reduction (overlapped with backward) and, for stage 3, the parameter
   coordinator (gather/release/prefetch hooks).
6. the optimizer over fp32 masters, the loss scaler, the LR schedule, the data loader.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zeal.config import Config, ConfigError, load_config
from zeal.data.sampler import ResumableDistributedSampler
from zeal.dist.comm import Comm
from zeal.dist.context import init_distributed
from zeal.precision.loss_scaler import LossScaler
from zeal.train.activation_checkpointing import apply_activation_checkpointing
from zeal.train.engine import EngineParts, TrainEngine
from zeal.train.lr_schedules import build_scheduler
from zeal.zero.grad_sync import GradReducer
from zeal.zero.offload.host_memory import return_freed_memory_eagerly
from zeal.zero.optimizer import ZeroOptimizer
from zeal.zero.param_coordinator import ParamCoordinator
from zeal.zero.shard_home import DiskShards, MemoryShards
from zeal.zero.swapped_optimizer import SwappedZeroOptimizer
from zeal.zero.units import (
    FlatUnit,
    build_bucket_units,
    build_module_units,
    default_init_fn,
    materialize_unit,
    replace_meta_parameters,
)
from zeal.zero.zeropp import UnitCollectives, build_topology

log = logging.getLogger("zeal")


def initialize(
    model: nn.Module | Callable[[], nn.Module],
    config: Config | dict | str | os.PathLike | None = None,
    optimizer: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None = None,
    lr_scheduler: Any = None,
    training_data: torch.utils.data.Dataset | None = None,
    init_fn: Callable[[nn.Module], None] | None = None,
) -> TrainEngine:
    """Wrap ``model`` for training under the given config; see :class:`TrainEngine`.

    ``model`` may be a factory (called under ``torch.device("meta")``): its
    parameters are then materialised unit by unit with ``init_fn`` (default: the
    model's ``_init_weights`` or each module's ``reset_parameters``).
    ``optimizer`` may be an instance built over the model's parameters (its
    param groups and hyper-parameters are kept and its parameters replaced by
    zeal's masters, so an ``lr_scheduler`` built on it keeps working), or a
    callable taking param groups.
    """
    cfg = load_config(config)
    ctx = init_distributed(cfg.dist_backend, cfg.local_world_size)
    try:
        _, micro, accum = cfg.resolve_batch(ctx.world_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if ctx.device.type == "cpu" and ctx.world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.local_world_size))
    comm = Comm(ctx)
    zc = cfg.zero_optimization
    stage = zc.stage
    if stage == 3 or "nvme" in (zc.offload_param.device, zc.offload_optimizer.device):
        # Stage 3 and the disk tier exist to bound memory; on CPU their per-step gather and
        # gradient buffers would otherwise stay resident as freed-but-kept heap.
        return_freed_memory_eagerly()

    # 2. the model
    if not isinstance(model, nn.Module):
        if not callable(model):
            raise TypeError(f"model must be an nn.Module or a factory, got {type(model).__name__}")
        with torch.device("meta"):
            model = model()
    init = init_fn or default_init_fn(model)
    apply_activation_checkpointing(model, cfg.activation_checkpointing)

    # 3. precision
    dtype = torch.bfloat16 if cfg.bf16.enabled else torch.float16 if cfg.fp16.enabled else torch.float32
    _prepare_non_unit_tensors(model, dtype, ctx.device, init)

    # 4. ZeRO layout
    groups, group_of = _param_groups(model, optimizer)
    home: MemoryShards | DiskShards = MemoryShards()
    with torch.no_grad():
        if stage < 3:
            for p in model.parameters():
                if not p.requires_grad:  # frozen: replicated, in the compute dtype
                    p.data = (torch.empty(p.shape, device=ctx.device, dtype=dtype) if p.is_meta
                              else p.data.to(device=ctx.device, dtype=dtype))
            units = build_bucket_units(model, groups, zc.reduce_bucket_size, ctx.rank, ctx.world_size,
                                       dtype, ctx.device)
            replace_meta_parameters(model, units)
            if any(u.needs_init for u in units):
                _materialize_all(model, units, init, cfg.seed)
            for u in units:
                comm.broadcast(u.full, 0, "init")
            for p in model.parameters():
                if not p.requires_grad:
                    comm.broadcast(p.data, 0, "init")
        else:
            units, needs = build_module_units(model, group_of, ctx.rank, ctx.world_size, dtype, ctx.device)
            replace_meta_parameters(model, units)
            op = zc.offload_param
            if op.device == "nvme":  # ZeRO-Infinity: parameter shards live in swap files
                home = DiskShards(units, _rank_folder(op.nvme_path, ctx.rank), op.buffer_count, op.buffer_size)
            owners = _unit_owners(model, units)
            for u in units:  # one unit whole at a time
                if u.needs_init:
                    materialize_unit(u, owners[u.index], init, cfg.seed)
                else:
                    comm.broadcast(u.full, 0, "init")
                    u.refresh_shard_from_full()
                u.free_full()
                home.adopt(u)
        for b in model.buffers():
            comm.broadcast(b, 0, "init")
    comm.stats.total.clear()

    # 5. gradient reduction and the stage-3 coordinator
    coordinator = None
    coll = None
    if stage == 3:
        zeropp = zc.zero_quantized_weights or zc.zero_quantized_gradients or zc.zero_hpz_partition_size > 1
        topo = build_topology(ctx, comm, zc.zero_hpz_partition_size) if zeropp and ctx.world_size > 1 else None
        coll = UnitCollectives(comm, zc, topo, home)
        coordinator = ParamCoordinator(
            model, units, needs, coll, zc.stage3_param_persistence_threshold, zc.stage3_prefetch_bucket_size,
            zc.stage3_max_reuse_distance, zc.stage3_max_live_parameters)
    mode = {0: "all_reduce", 1: "scatter_at_boundary"}.get(stage, "scatter_every_step")
    reducer = GradReducer(units, comm, mode, overlap=zc.overlap_comm, max_inflight_elems=zc.reduce_bucket_size,
                          on_grads_taken=coordinator.on_grads_taken if coordinator else None,
                          scatter=coll.reduce_scatter if coll else None)

    # 6. optimizer, scaler, schedule, data
    scaler = LossScaler(cfg.fp16) if cfg.fp16.enabled else None
    oo = zc.offload_optimizer
    if oo.device == "nvme":  # ZeRO-Infinity: masters and moments in swap files
        if optimizer is not None:
            raise ConfigError("zero_optimization.offload_optimizer.device 'nvme' builds its own Adam/AdamW "
                              "from the config's optimizer section; do not pass an optimizer")
        spec = cfg.optimizer
        try:
            zopt = SwappedZeroOptimizer(
                units, reducer, comm, stage, spec.type if spec else "AdamW",
                dict(spec.params) if spec else {"lr": 1e-3}, cfg.gradient_clipping, scaler, home,
                _rank_folder(oo.nvme_path, ctx.rank), zc.sub_group_size, max(oo.buffer_count, 3))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        inner = zopt.optimizer
    else:
        inner = _inner_optimizer(cfg, optimizer, units)
        master_device = torch.device("cpu") if oo.device == "cpu" else None  # ZeRO-Offload
        zopt = ZeroOptimizer(units, reducer, comm, stage, inner, cfg.gradient_clipping, scaler, home,
                             master_device)
        zopt.bind(inner.param_groups)
    scheduler = _scheduler(cfg, lr_scheduler, inner)
    loader = None
    if training_data is not None:
        sampler = ResumableDistributedSampler(len(training_data), ctx.world_size, ctx.rank, seed=cfg.seed,
                                              batch_size=micro)
        loader = torch.utils.data.DataLoader(training_data, batch_size=micro, sampler=sampler, drop_last=True)
    comm.stats.step.clear()
    parts = EngineParts(model, cfg, ctx, comm, units, reducer, zopt, coordinator, scaler, scheduler, loader,
                        dtype, micro, accum)
    return TrainEngine(parts)


def _rank_folder(path: str, rank: int) -> str:
    """Each rank swaps into its own sub-folder of the configured path (checked to exist)."""
    if not os.path.isdir(path):
        raise ConfigError(f"nvme_path '{path}' does not exist or is not a folder")
    sub = os.path.join(path, f"zeal-rank{rank}")
    try:
        os.makedirs(sub, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"nvme_path '{path}' is not writable: {e}") from None
    return sub


def _prepare_non_unit_tensors(model: nn.Module, dtype: torch.dtype, device: torch.device,
                              init: Callable[[nn.Module], None]) -> None:
    """Buffers and frozen parameters: to the device and (floating point) to the compute dtype.
    Meta buffers are materialised by their module's initialiser."""
    for mod in model.modules():
        for name, b in list(mod.named_buffers(recurse=False)):
            if b is None:
                continue
            if b.is_meta:
                mod.to_empty(device=device, recurse=False)
                init(mod)
                b = getattr(mod, name)
            new = b.to(device=device, dtype=dtype if b.is_floating_point() else b.dtype)
            setattr(mod, name, new)


def _param_groups(model: nn.Module, optimizer: Any) -> tuple[list[list[nn.Parameter]], dict[int, int]]:
    """Trainable parameters grouped as the client optimizer groups them (one group otherwise)."""
    seen: set[int] = set()
    params = []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    if isinstance(optimizer, torch.optim.Optimizer):
        group_of = {}
        for gi, g in enumerate(optimizer.param_groups):
            for p in g["params"]:
                group_of[id(p)] = gi
        missing = [p for p in params if p.requires_grad and id(p) not in group_of]
        if missing:
            raise ValueError(f"{len(missing)} trainable parameters of the model are not in the optimizer")
        groups = [[p for p in params if group_of.get(id(p)) == gi] for gi in range(len(optimizer.param_groups))]
        return groups, group_of
    return [params], {id(p): 0 for p in params}


def _inner_optimizer(cfg: Config, optimizer: Any, units: list[FlatUnit]) -> torch.optim.Optimizer:
    dummy = [torch.zeros(1, requires_grad=True)]
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if callable(optimizer):
        return optimizer(dummy)
    spec = cfg.optimizer
    name, params = (spec.type, dict(spec.params)) if spec else ("AdamW", {"lr": 1e-3})
    lookup = {k.lower(): getattr(torch.optim, k) for k in dir(torch.optim)
              if isinstance(getattr(torch.optim, k), type) and issubclass(getattr(torch.optim, k), torch.optim.Optimizer)}
    cls = lookup.get(name.lower())
    if cls is None or cls is torch.optim.LBFGS:
        raise ConfigError(f"config key 'optimizer.type': unknown or unsupported optimizer {name!r} "
                          "(Adam, AdamW, SGD or an elementwise torch.optim class)")
    if "betas" in params:
        params["betas"] = tuple(params["betas"])
    if cls in (torch.optim.Adam, torch.optim.AdamW) and not {"fused", "foreach"} & params.keys():
        # one pass over memory per tensor, no full-size temporaries: on CPU torch's default
        # is the per-tensor loop (measured 193 ms -> see bench/README.md for a 62M-element shard)
        params["fused"] = True
    try:
        n_groups = 1 + max((u.group for u in units), default=0)
        return cls([{"params": [torch.zeros(1, requires_grad=True)]} for _ in range(n_groups)], **params)
    except TypeError as e:
        raise ConfigError(f"config key 'optimizer.params': {e}") from None


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


def _unit_owners(model: nn.Module, units: list[FlatUnit]) -> dict[int, list[nn.Module]]:
    """For each unit, the modules that register (and so initialise) its parameters first."""
    unit_of = {id(p): u for u in units for p in u.params}
    owners: dict[int, list[nn.Module]] = {}
    seen: set[int] = set()
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            if id(p) in seen or id(p) not in unit_of:
                continue
            seen.add(id(p))
            mods = owners.setdefault(unit_of[id(p)].index, [])
            if mod not in mods:
                mods.append(mod)
    return owners


def _materialize_all(model: nn.Module, units: list[FlatUnit], init: Callable[[nn.Module], None], seed: int) -> None:
    """Stages 0–2 keep the whole model on every rank anyway: initialise it in one go."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for m in model.modules():
            if list(m.parameters(recurse=False)):
                init(m)
    for u in units:
        u.needs_init = False
