"""The ZeRO optimizer step with fp32 masters and Adam moments on disk (ZeRO-Infinity,
``offload_optimizer.device: nvme``).

This rank's shards of every trainable unit are laid end to end in one flat space;
:class:`~zeal.zero.offload.SwappedAdam` keeps masters, exp_avg and exp_avg_sq for
that space in swap files and streams it through a bounded buffer pool by
sub-group. Gradients stay in memory (the reducer's shard accumulators, in the
compute dtype, upcast per sub-group). Each updated fp32 chunk is handed back as
it is produced and written into the model's shards (in memory, or through the
stage-3 parameter home on disk), so the full master never exists in memory.
Only Adam and AdamW are supported on this path, as in DeepSpeed.
"""

from __future__ import annotations

import torch

from zeal.dist.comm import Comm
from zeal.precision.loss_scaler import LossScaler
from zeal.zero.grad_sync import GradReducer
from zeal.zero.offload import CPUAdam, SwappedAdam, check_swap_path
from zeal.zero.offload.staging import Staging
from zeal.zero.offload.swap import OPTIMIZER_PATH_KEY
from zeal.zero.optimizer import GradNorm, spread_flags, unscale_check_clip
from zeal.zero.shard_home import DiskShards, MemoryShards
from zeal.zero.stages import ZeroStage, gather_replicated, resolve_stage
from zeal.zero.units import FlatUnit


class LrGroups:
    """The part of an optimizer an LR schedule touches: ``param_groups[i]["lr"]``."""

    def __init__(self, lr: float) -> None:
        self.param_groups = [{"lr": lr, "initial_lr": lr}]
        self.state: dict = {}


class SwappedZeroOptimizer:
    def __init__(self, units: list[FlatUnit], reducer: GradReducer, comm: Comm, stage: ZeroStage | int,
                 opt_type: str, opt_params: dict, clip: float, scaler: LossScaler | None,
                 home: MemoryShards | DiskShards, nvme_path: str, sub_group_size: int, buffer_count: int,
                 grad_norm: GradNorm | None = None, staging: Staging | None = None) -> None:
        if opt_type not in ("Adam", "AdamW"):
            raise ValueError(f"zero_optimization.offload_optimizer.device 'nvme' supports Adam and AdamW, "
                             f"not {opt_type!r}")
        params = dict(opt_params)
        lr = float(params.pop("lr", 1e-3))
        bad = sorted(set(params) - {"betas", "eps", "weight_decay", "fused", "foreach"})
        if bad:
            raise ValueError(f"config key 'optimizer.params.{bad[0]}' is not supported with nvme offload")
        self.units = [u for u in units if u.trainable]
        self.reducer, self.comm, self.stage, self.home = reducer, comm, resolve_stage(stage), home
        self.clip, self.scaler = clip, scaler
        # the device/host boundary (the swap files and the Adam step are on the host)
        self.staging = staging or Staging(self.units[0].device if self.units else "cpu")
        self.offsets = []
        total = 0
        for u in self.units:
            self.offsets.append(total)
            total += u.shard_numel
        self.numel = total
        check_swap_path(nvme_path, 12 * total, OPTIMIZER_PATH_KEY)
        adam = CPUAdam(lr=lr, betas=tuple(params.get("betas", (0.9, 0.999))), eps=params.get("eps", 1e-8),
                       weight_decay=params.get("weight_decay", 0.01 if opt_type == "AdamW" else 0.0),
                       adamw=opt_type == "AdamW", fused=params.get("fused", not params.get("foreach", False)))
        self.swapped = SwappedAdam(total, adam, nvme_path, sub_group_size=min(sub_group_size, max(total, 1)),
                                   buffer_count=buffer_count)
        for u, off in zip(self.units, self.offsets):  # initial masters: the current shards, in fp32
            host = self.staging.to_host(home.get(u), dtype=torch.float32)
            self.staging.wait_host()
            self.swapped.write_master(host, off)
            home.done(u)
        self.optimizer = LrGroups(lr)
        self.last_grad_norm: float | None = None
        self.skipped_steps = 0
        self.grad_norm = grad_norm  # see zeal.zero.optimizer.unscale_check_clip
        self.last_stats = None
        self._pieces: dict[int, torch.Tensor] = {}  # a unit's updated values, gathered on the host
        self.masters: list[torch.Tensor] = []  # only inside load_into_memory()

    def step(self) -> bool:
        grads = [self.reducer.reduced_grad(u) for u in self.units]
        ok, self.last_grad_norm = unscale_check_clip(grads, self.comm, self.stage, self.scaler, self.clip,
                                                         self.grad_norm, getattr(self, "across", None),
                                                         spread_flags(self))
        if not ok:
            self.skipped_steps += 1
            return False
        flat = self.staging.to_host(self.reducer.flat_grads(self.units, grads), key="grads")
        self.staging.wait_host()
        self.last_stats = self.swapped.step(flat, on_update=self._on_update,
                                            lr=self.optimizer.param_groups[0]["lr"])
        if not self.stage.partitions_params:  # stages 1-2: rebuild the replicated units
            gather_replicated(self.comm, self.units)
        return True

    @torch.no_grad()
    def _on_update(self, start: int, chunk: torch.Tensor) -> None:
        """Copy the updated fp32 master elements [start, start + len) into unit shards."""
        end = start + chunk.numel()
        for u, off in zip(self.units, self.offsets):
            lo, hi = max(start, off), min(end, off + u.shard_numel)
            if lo >= hi:
                continue
            piece = chunk[lo - start:hi - start]
            if not self.home.lends and not self.staging.crosses:
                u.shard[lo - off:hi - off].copy_(piece)
                continue
            host = self._pieces.get(u.index)
            if host is None:  # the chunk is a reused swap buffer: gather the unit in its own host buffer
                host = self._pieces[u.index] = self.staging.host_empty(u.shard_numel, u.dtype)
            host[lo - off:hi - off].copy_(piece)
            if hi == off + u.shard_numel:  # the unit's last element: store it whole
                self.home.put_host(u, self._pieces.pop(u.index), self.staging)

    # -- whole-state access for checkpoints (see zeal.zero.offload_view) -------------------
    def load_into_memory(self) -> None:
        """Read masters and moments into ``self.masters`` / ``self.optimizer.state``."""
        self.masters = []
        self.optimizer.state = {}
        step = self.swapped.steps[0] if self.swapped.steps else 0
        for u, off in zip(self.units, self.offsets):
            m = torch.empty(u.shard_numel)
            self.swapped.read_master(m, off)
            self.masters.append(m)
            if step > 0:
                st = {"step": torch.tensor(float(step))}
                for k in ("exp_avg", "exp_avg_sq"):
                    st[k] = torch.empty(u.shard_numel)
                    self.swapped.read_state(k, st[k], off)
                self.optimizer.state[m] = st

    def release_memory(self, writeback: bool) -> None:
        """Drop the in-memory copy; with ``writeback`` store it (and the step count) first."""
        if writeback:
            steps = {int(st["step"]) for st in self.optimizer.state.values() if "step" in st}
            if len(steps) > 1:
                raise ValueError(f"units disagree on the Adam step count {sorted(steps)}")
            step = steps.pop() if steps else 0
            for off, m in zip(self.offsets, self.masters):
                self.swapped.write_master(m, off)
                st = self.optimizer.state.get(m)
                if st is not None and step > 0:
                    for k in ("exp_avg", "exp_avg_sq"):
                        self.swapped.write_state(k, st[k].float(), off)
            self.swapped.set_steps([step] * len(self.swapped.steps))
        self.masters = []
        self.optimizer.state = {}

    def write_back(self) -> None:
        """Push the in-memory masters (inside load_into_memory) into the model's shards."""
        self.stage.write_back(self.units, self.masters, self.comm, self.home,
                              self.staging if self.staging.crosses else None)

    def nbytes(self) -> int:
        """Optimizer bytes held in memory: the swap buffer pool."""
        return self.swapped.cpu_bytes

    def disk_bytes(self) -> int:
        return self.swapped.disk_bytes

    def close(self) -> None:
        self.swapped.close()
