"""The ZeRO apply-step: lay a model's parameters out over the data-parallel Comm.

1. trainable parameters move into flat units (buckets for stages 0–2, one per module
   for stage 3), in the compute dtype; values are made identical on every dp rank
   (broadcast from dp rank 0, or deterministic per-unit materialisation of meta
   parameters, so no rank ever holds the whole model in stage 3); stage-3 shards go to
   their home (device memory; host memory under ``offload_param.device: cpu`` on an
   accelerator; swap files under ``offload_param.device: nvme``), written there as they
   are materialised, across the device boundary through a ``Staging``;
2. gradient reduction (overlapped with backward) and, for stage 3, the parameter
   coordinator (gather/release/prefetch hooks), registered as step hooks.

Parameters that live on a sub-group of the data-parallel ranks come as
:class:`~zeal.zero.groups.CommGroup` s, each with its own Comm (the caller says which
parameters and why): their units, broadcasts, gathers and reductions use that Comm.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from zeal.config import ConfigError
from zeal.config.schema import ZeroConfig
from zeal.dist.comm import Comm
from zeal.dist.mesh import Mesh
from zeal.zero.grad_sync import GradReducer
from zeal.zero.groups import CommGroup, RoutedCollectives, RoutedReducer, comm_of, group_index, split_groups
from zeal.zero.offload.staging import Staging
from zeal.zero.param_coordinator import ParamCoordinator
from zeal.zero.shard_home import DiskShards, HostShards, MemoryShards
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
    reducer, the stage-3 coordinator (None below stage 3), the step hooks to register and
    the CommGroups it was given."""

    stage: ZeroStage
    units: list[FlatUnit]
    home: MemoryShards | HostShards | DiskShards
    reducer: GradReducer | RoutedReducer
    coordinator: ParamCoordinator | None
    hooks: list[object]
    comm_groups: list[CommGroup] = field(default_factory=list)


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


def check_offload_device(zc: ZeroConfig, device: torch.device) -> None:
    """Refuse, in one line, an offload tier on a device it does not cross from. Every tier
    crosses between a CPU or CUDA device and the host through a
    :class:`~zeal.zero.offload.staging.Staging` (pinned buffers and a copy stream on CUDA);
    other accelerators are not wired (no pinning, no streams), so their offload is refused."""
    if device.type in ("cpu", "cuda"):
        return
    for key, sec in (("offload_param", zc.offload_param), ("offload_optimizer", zc.offload_optimizer)):
        if sec.device != "none":
            raise ConfigError(f"config key 'zero_optimization.{key}.device' {sec.device!r} is not supported on "
                              f"{device.type} (offload crosses from cpu or cuda devices only); use 'none'")


def apply_zero(model: nn.Module, zc: ZeroConfig, mesh: Mesh, dtype: torch.dtype, groups: list[list[nn.Parameter]],
               group_of: dict[int, int], init: Callable[[nn.Module], None], seed: int,
               comm_groups: list[CommGroup] | None = None) -> ZeroParts:
    """Partition ``model`` over ``mesh.dp`` as ``zc.stage`` says, and each of ``comm_groups``
    over its own Comm; see the module docstring."""
    stage = resolve_stage(zc.stage)
    check_offload_device(zc, mesh.device)
    comm = mesh.dp
    cgs = list(comm_groups or [])
    home: MemoryShards | HostShards | DiskShards = MemoryShards()
    needs = None
    with torch.no_grad():
        if not stage.partitions_params:
            units = _replicated_layout(model, zc, comm, mesh, dtype, groups, init, seed, cgs)
        else:
            def placement(p: nn.Parameter) -> tuple[int, int, int]:
                i = group_index(cgs, p)
                c = cgs[i - 1].comm if i else comm
                return i, c.rank if i else mesh.dp_rank, c.size if i else mesh.dp_size

            units, needs = build_module_units(model, group_of, mesh.dp_rank, mesh.dp_size, dtype, mesh.device,
                                              placement=placement if cgs else None)
            for u in units:  # a group's units are sharded over its Comm
                if u.comm_group:
                    u.comm = cgs[u.comm_group - 1].comm
            replace_meta_parameters(model, units)
            op = zc.offload_param
            staging = Staging(mesh.device, op.pin_memory)
            if op.device == "nvme":  # ZeRO-Infinity: parameter shards live in swap files
                home = DiskShards(units, rank_folder(op.nvme_path, mesh.rank), op.buffer_count, op.buffer_size,
                                  staging)
            elif op.device == "cpu" and staging.crosses:  # on a CPU device, memory is the host already
                home = HostShards(staging)
            owners = _unit_owners(model, units)
            for u in units:  # one unit whole at a time
                if u.needs_init:
                    materialize_unit(u, owners[u.index], init, seed)
                else:
                    (u.comm or comm).broadcast(u.full, 0, "init")
                    u.refresh_shard_from_full()
                u.free_full()
                home.adopt(u)
        for b in model.buffers():
            comm_of(cgs, comm, b, buffer=True).broadcast(b, 0, "init")

    coordinator = coll = None
    hooks: list[object] = []
    if stage.partitions_params:
        coll = UnitCollectives(comm, zc, topology(mesh), home)
        if cgs:  # each group's units gathered over its Comm
            coll = RoutedCollectives([coll] + [UnitCollectives(g.comm, zc, None, home) for g in cgs])
        coordinator = ParamCoordinator(
            model, units, needs, coll, zc.stage3_param_persistence_threshold, zc.stage3_prefetch_bucket_size,
            zc.stage3_max_reuse_distance, zc.stage3_max_live_parameters)
    on_grads_taken = coordinator.on_grads_taken if coordinator else None
    reducer = GradReducer([u for u in units if not u.comm_group], comm, stage.grad_mode, overlap=zc.overlap_comm,
                          max_inflight_elems=zc.reduce_bucket_size, on_grads_taken=on_grads_taken,
                          scatter=coll.reduce_scatter if coll else None)
    if cgs:  # each group's gradients reduced over its Comm, averaged over its mean_over ranks
        reducer = RoutedReducer([reducer] + [GradReducer(
            [u for u in units if u.comm_group == i], g.comm, stage.grad_mode, overlap=zc.overlap_comm,
            max_inflight_elems=zc.reduce_bucket_size, mean_over=g.mean_over, on_grads_taken=on_grads_taken)
            for i, g in enumerate(cgs, start=1)],
            [(i, g.spread) for i, g in enumerate(cgs, start=1) if g.spread is not None])
    hooks.append(ReducerHooks(reducer))
    if coordinator is not None:
        hooks.append(CoordinatorHooks(coordinator))
    return ZeroParts(stage, units, home, reducer, coordinator, hooks, cgs)


def _replicated_layout(model: nn.Module, zc: ZeroConfig, comm: Comm, mesh: Mesh, dtype: torch.dtype,
                       groups: list[list[nn.Parameter]], init: Callable[[nn.Module], None],
                       seed: int, cgs: list[CommGroup]) -> list[FlatUnit]:
    """Stages 0–2: every rank holds whole units (buckets; each CommGroup's after ZeRO's own,
    sharded over its Comm); frozen parameters stay outside them, replicated in the compute dtype."""
    for p in model.parameters():
        if not p.requires_grad:
            p.data = (torch.empty(p.shape, device=mesh.device, dtype=dtype) if p.is_meta
                      else p.data.to(device=mesh.device, dtype=dtype))
    own, *by_group = split_groups(groups, cgs)
    units = build_bucket_units(model, own, zc.reduce_bucket_size, mesh.dp_rank, mesh.dp_size, dtype, mesh.device)
    for i, (g, gparams) in enumerate(zip(cgs, by_group), start=1):
        more = build_bucket_units(model, gparams, zc.reduce_bucket_size, g.comm.rank, g.comm.size, dtype, mesh.device)
        for u in more:  # indices follow the units before them
            u.index += len(units)
            u.comm, u.comm_group = g.comm, i
        units += more
    replace_meta_parameters(model, units)
    if any(u.needs_init for u in units):
        _materialize_all(model, units, init, seed)
    for u in units:
        (u.comm or comm).broadcast(u.full, 0, "init")
    for p in model.parameters():
        if not p.requires_grad:
            comm_of(cgs, comm, p).broadcast(p.data, 0, "init")
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
