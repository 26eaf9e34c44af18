"""The ZeRO apply-step: lay a model's parameters out over the data-parallel Comm.

1. trainable parameters move into flat units (buckets for stages 0–2, one per module
   for stage 3), in the compute dtype; values are made identical on every dp rank
   (broadcast from dp rank 0, or deterministic per-unit materialisation of meta
   parameters, so no rank ever holds the whole model in stage 3); stage-3 shards go to
   their home (memory, or swap files under ``offload_param.device: nvme``, since shards
   are written there as they are materialised);
2. gradient reduction (overlapped with backward) and, for stage 3, the parameter
   coordinator (gather/release/prefetch hooks), registered as step hooks.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from zeal.config import ConfigError
from zeal.config.schema import ZeroConfig
from zeal.dist.comm import Comm
from zeal.dist.mesh import Mesh
from zeal.moe.layer import is_expert_param
from zeal.moe.zero import (
    ExpertSplitCollectives,
    ExpertSplitReducer,
    build_expert_units,
    expert_buffer_ids,
    mark_expert_units,
    partitioned_expert_split,
    split_expert_groups,
)
from zeal.zero.grad_sync import GradReducer
from zeal.zero.param_coordinator import ParamCoordinator
from zeal.zero.shard_home import DiskShards, MemoryShards
from zeal.zero.stages import ZeroStage, resolve_stage
from zeal.zero.units import (
    FlatUnit,
    build_bucket_units,
    build_module_units,
    materialize_unit,
    replace_meta_parameters,
)
from zeal.zero.zeropp import UnitCollectives, topology


@dataclass
class ZeroParts:
    """What the ZeRO step adds: the units, the stage's strategy, where shards live, the
    reducer, the stage-3 coordinator (None below stage 3) and the step hooks to register."""

    stage: ZeroStage
    units: list[FlatUnit]
    home: MemoryShards | DiskShards
    reducer: GradReducer
    coordinator: ParamCoordinator | None
    hooks: list[object]


class ReducerHooks:
    """Step hooks of the gradient reducer: open and close each backward's reductions,
    drop the reduced gradients after the step."""

    def __init__(self, reducer: GradReducer) -> None:
        self.reducer = reducer

    def before_backward(self, boundary: bool) -> None:
        self.reducer.begin_backward(boundary)

    def after_backward(self) -> None:
        self.reducer.finish_backward()  # reduces units whose hooks did not (unused parameters), waits

    def after_step(self, applied: bool) -> None:
        self.reducer.zero()

    def close(self) -> None:
        self.reducer.wait_all()  # nothing new is sent: only what is in flight completes


class CoordinatorHooks:
    """Step hooks of the stage-3 coordinator: backward bookkeeping, refreshing persistent
    units after an applied step, and the end of the step's gathers."""

    def __init__(self, coordinator: ParamCoordinator) -> None:
        self.coordinator = coordinator

    def before_backward(self, boundary: bool) -> None:
        self.coordinator.begin_backward()

    def after_backward(self) -> None:
        self.coordinator.finish_backward()

    def after_step(self, applied: bool) -> None:
        if applied:
            self.coordinator.refresh_persistent()
        self.coordinator.end_step()

    def close(self) -> None:
        self.coordinator.end_step()
        self.coordinator.remove_hooks()


def apply_zero(model: nn.Module, zc: ZeroConfig, mesh: Mesh, dtype: torch.dtype, groups: list[list[nn.Parameter]],
               group_of: dict[int, int], init: Callable[[nn.Module], None], seed: int) -> ZeroParts:
    """Partition ``model`` over ``mesh.dp`` as ``zc.stage`` says; see the module docstring."""
    stage = resolve_stage(zc.stage)
    comm = mesh.dp
    home: MemoryShards | DiskShards = MemoryShards()
    needs = None
    with torch.no_grad():
        if not stage.partitions_params:
            units = _replicated_layout(model, zc, comm, mesh, dtype, groups, init, seed)
        else:
            units, needs = build_module_units(model, group_of, mesh.dp_rank, mesh.dp_size, dtype, mesh.device,
                                              experts=partitioned_expert_split(mesh.edp_rank, mesh.edp_size))
            mark_expert_units(units, mesh.edp)  # MoE: expert units sharded over edp
            replace_meta_parameters(model, units)
            op = zc.offload_param
            if op.device == "nvme":  # ZeRO-Infinity: parameter shards live in swap files
                home = DiskShards(units, rank_folder(op.nvme_path, mesh.rank), op.buffer_count, op.buffer_size)
            owners = _unit_owners(model, units)
            for u in units:  # one unit whole at a time
                if u.needs_init:
                    materialize_unit(u, owners[u.index], init, seed)
                else:
                    (u.comm or comm).broadcast(u.full, 0, "init")
                    u.refresh_shard_from_full()
                u.free_full()
                home.adopt(u)
        expert_buffers = expert_buffer_ids(model)
        for b in model.buffers():
            (mesh.edp if id(b) in expert_buffers else comm).broadcast(b, 0, "init")

    coordinator = coll = None
    hooks: list[object] = []
    if stage.partitions_params:
        coll = UnitCollectives(comm, zc, topology(mesh), home)
        if any(u.expert for u in units):  # MoE: expert units gathered over edp
            coll = ExpertSplitCollectives(coll, UnitCollectives(mesh.edp, zc, None, home))
        coordinator = ParamCoordinator(
            model, units, needs, coll, zc.stage3_param_persistence_threshold, zc.stage3_prefetch_bucket_size,
            zc.stage3_max_reuse_distance, zc.stage3_max_live_parameters)
    reducer = GradReducer([u for u in units if not u.expert], comm, stage.grad_mode, overlap=zc.overlap_comm,
                          max_inflight_elems=zc.reduce_bucket_size,
                          on_grads_taken=coordinator.on_grads_taken if coordinator else None,
                          scatter=coll.reduce_scatter if coll else None)
    if any(u.expert for u in units):  # MoE: expert gradients reduced over edp only
        reducer = ExpertSplitReducer(reducer, GradReducer(
            [u for u in units if u.expert], mesh.edp, stage.grad_mode, overlap=zc.overlap_comm,
            max_inflight_elems=zc.reduce_bucket_size, mean_over=mesh.dp_size,
            on_grads_taken=coordinator.on_grads_taken if coordinator else None), mesh.ep)
    hooks.append(ReducerHooks(reducer))
    if coordinator is not None:
        hooks.append(CoordinatorHooks(coordinator))
    return ZeroParts(stage, units, home, reducer, coordinator, hooks)


def _replicated_layout(model: nn.Module, zc: ZeroConfig, comm: Comm, mesh: Mesh, dtype: torch.dtype,
                       groups: list[list[nn.Parameter]], init: Callable[[nn.Module], None],
                       seed: int) -> list[FlatUnit]:
    """Stages 0–2: every rank holds whole units (buckets); frozen parameters stay outside
    them, replicated in the compute dtype."""
    for p in model.parameters():
        if not p.requires_grad:
            p.data = (torch.empty(p.shape, device=mesh.device, dtype=dtype) if p.is_meta
                      else p.data.to(device=mesh.device, dtype=dtype))
    groups, expert_groups = split_expert_groups(groups)
    units = build_bucket_units(model, groups, zc.reduce_bucket_size, mesh.dp_rank, mesh.dp_size, dtype, mesh.device)
    units += build_expert_units(model, expert_groups, zc.reduce_bucket_size, mesh.edp, mesh.edp_rank, len(units),
                                dtype, mesh.device)
    replace_meta_parameters(model, units)
    if any(u.needs_init for u in units):
        _materialize_all(model, units, init, seed)
    for u in units:
        (u.comm or comm).broadcast(u.full, 0, "init")
    for p in model.parameters():
        if not p.requires_grad:
            (mesh.edp if is_expert_param(p) else comm).broadcast(p.data, 0, "init")
    return units


def rank_folder(path: str, rank: int) -> str:
    """Each rank swaps into its own sub-folder of the configured path (checked to exist)."""
    if not os.path.isdir(path):
        raise ConfigError(f"nvme_path '{path}' does not exist or is not a folder")
    sub = os.path.join(path, f"zeal-rank{rank}")
    try:
        os.makedirs(sub, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"nvme_path '{path}' is not writable: {e}") from None
    return sub


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
