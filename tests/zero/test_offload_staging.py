"""The offload tiers' device crossing, run on CPU with the staging path forced on (a CPU
"device" treated as an accelerator): every copy between the device and the host goes through
the :class:`~zeal.zero.offload.staging.Staging` buffers (counted), the parameters of stage-3
``offload_param: cpu`` really leave the device (before: they stayed put, W1), and training equals
the run without offload bit for bit (per-tensor AdamW). Before, the optimizer tiers copied with
plain ``.to``/``copy_`` (the NVMe tiers handed device tensors to the swap store, C1)."""

from __future__ import annotations

import pytest
import torch

import zeal
from tests.train.models import TinyNet, make_batches
from tests.zero.resume import straight_and_resumed
from zeal.zero.offload import staging as staging_mod
from zeal.zero.offload.staging import Staging
from zeal.zero.shard_home import DiskShards, HostShards

VARIANTS = {
    "none": {},
    "cpu": {"offload_optimizer": {"device": "cpu", "pin_memory": True}},
    "param_cpu": {"offload_param": {"device": "cpu", "pin_memory": True}},
    "param_cpu_opt_cpu": {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
    "nvme_opt": {"offload_optimizer": {"device": "nvme", "nvme_path": "{path}"}, "sub_group_size": 100},
    "nvme_all": {"offload_optimizer": {"device": "nvme", "nvme_path": "{path}"},
                 "offload_param": {"device": "nvme", "nvme_path": "{path}"}, "sub_group_size": 300},
}


def _engine(stage: int, variant: str, path: str, dtype: str | None = None):
    zo: dict = {"stage": stage, "stage3_param_persistence_threshold": 0}
    for k, v in VARIANTS[variant].items():
        zo[k] = {kk: (vv.format(path=path) if isinstance(vv, str) else vv) for kk, vv in v.items()} \
            if isinstance(v, dict) else v
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.05,
           "zero_optimization": zo,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1, "fused": False}}}
    if dtype:
        cfg[dtype] = {"enabled": True}
    torch.manual_seed(0)
    return zeal.initialize(TinyNet(), cfg)


def _train(engine) -> dict:
    for step in make_batches(3, 2, 1, 2):
        for micro in step:
            engine.backward(engine(micro[0]))
            engine.step()
    state = engine.module_state_dict()
    engine.close()
    return state


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setattr(staging_mod, "FORCE_CROSSING", True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage, variant", [(1, "cpu"), (2, "nvme_opt"), (3, "cpu"), (3, "param_cpu"),
                                            (3, "param_cpu_opt_cpu"), (3, "nvme_all")])
def test_forced_staging_equals_training_without_offload(forced, tmp_path, stage, variant):
    ref = _train(_engine(stage, "none", str(tmp_path)))
    engine = _engine(stage, variant, str(tmp_path))
    zopt, home = engine._p.zero_optimizer, engine._p.coordinator.coll.home if stage == 3 else None
    opt_staging = getattr(zopt, "staging", None)
    if variant.startswith("param_cpu"):  # the shards left the device: host copies, nothing in unit.shard
        assert isinstance(home, HostShards) and all(u.shard.numel() == 0 for u in engine._p.units)
        assert engine.memory_breakdown()["params"] == 0
    if variant == "nvme_all":
        assert isinstance(home, DiskShards) and home.staging.crosses
    state = _train(engine)
    for k in ref:
        assert torch.equal(state[k], ref[k]), (stage, variant, k)
    used = [s for s in (opt_staging, getattr(home, "staging", None)) if s is not None]
    assert used and all(s.crosses for s in used)
    assert sum(s.stats.downloads for s in used) > 0 and sum(s.stats.uploads for s in used) > 0


@pytest.mark.timeout(60)
def test_cpu_offload_counts_one_download_and_upload_per_unit_and_step(forced, tmp_path):
    """ZeRO-Offload: each step downloads every unit's reduced gradient once and uploads its
    updated values once, through the staging buffers (the same host buffers every step)."""
    engine = _engine(2, "cpu", str(tmp_path))
    zopt = engine._p.zero_optimizer
    n = len(zopt.units)
    assert zopt.staging.stats.downloads == n  # the initial masters
    _train(engine)
    assert zopt.staging.stats.downloads == n + 3 * n and zopt.staging.stats.uploads == 3 * n
    assert all(m.grad is None for m in zopt.masters)
    assert all(m.data_ptr() != u.shard.data_ptr() for m, u in zip(zopt.masters, zopt.units))


def test_bf16_cpu_offload_uploads_in_the_compute_dtype(forced, tmp_path):
    """bf16 units with fp32 host masters: the conversion happens on the host, so half the
    bytes cross (DeepSpeed does the same), and the result equals the unforced run."""
    ref = _train(_engine(3, "cpu", str(tmp_path), "bf16"))
    engine = _engine(3, "cpu", str(tmp_path), "bf16")
    zopt = engine._p.zero_optimizer
    state = _train(engine)
    numel = sum(u.shard_numel for u in zopt.units)
    assert zopt.staging.stats.bytes_up == 3 * numel * 2  # bf16 over the bus
    for k in ref:
        assert torch.equal(state[k], ref[k]), k


def test_staging_without_a_boundary_is_the_identity():
    s = Staging("cpu", pin_memory=True)
    x = torch.arange(6.0)
    assert not s.crosses and s.to_host(x) is not None and s.to_host(x).data_ptr() == x.data_ptr()
    assert s.to_device(x) is x and s.stats.downloads == s.stats.uploads == 0


def test_pin_memory_plumbing(tmp_path):
    """pin_memory reaches the staging of both tiers; pinned buffers are used only on CUDA
    (on CPU it is requested but off: torch would need a CUDA context to pin)."""
    for forced_on in (False, True):
        staging_mod.FORCE_CROSSING = forced_on
        try:
            engine = _engine(3, "param_cpu_opt_cpu", str(tmp_path))
            engine2 = _engine(3, "param_cpu", str(tmp_path))
        finally:
            staging_mod.FORCE_CROSSING = False
        if not forced_on:  # a CPU device: no boundary, the host masters need no staging
            assert engine._p.zero_optimizer.staging is None
        else:
            assert engine._p.zero_optimizer.staging.pin_requested is False  # the config's default
            home = engine2._p.coordinator.coll.home
            assert home.staging.pin_requested is True and home.staging.pinned is torch.cuda.is_available()
        engine.close()
        engine2.close()
    s = Staging(torch.device("cuda", 0), pin_memory=True)
    assert s.crosses and s.pinned == torch.cuda.is_available()


class _Recorder:
    """A fake stream: records what the staging asks of it."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def __enter__(self):
        self.log.append(("enter", self.name))
        return self

    def __exit__(self, *exc):
        self.log.append(("exit", self.name))

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, ev):
        self.log.append(("wait_event", self.name, ev))

    def record_event(self):
        self.log.append(("record", self.name))
        return _Event(self.name, self.log)

    def keep(self, t):
        self.log.append(("keep", self.name))


class _Event:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def synchronize(self):
        self.log.append(("sync", self.name))


def test_copies_ordered_by_stream_and_events(monkeypatch):
    """Downloads: the copy stream first waits for compute, then the copy, then an event the host
    waits on once (wait_host); uploads: compute waits on the copy's event (no host block)."""
    log: list = []
    s = Staging("cpu", force=True, stream=_Recorder("copy", log))
    monkeypatch.setattr(s, "compute_stream", lambda: _Recorder("compute", log))
    src = torch.arange(4.0)
    a, b = s.to_host(src), s.to_host(src * 2)
    assert log == [("wait_stream", "copy", "compute"), ("enter", "copy"), ("exit", "copy"), ("keep", "copy"),
                   ("record", "copy")] * 2
    log.clear()
    s.wait_host()
    assert log == [("sync", "copy"), ("sync", "copy")] and torch.equal(b, src * 2) and torch.equal(a, src)
    log.clear()
    dst = torch.empty(4)
    s.upload(dst, a)
    assert [e[:2] for e in log] == [("wait_stream", "copy"), ("enter", "copy"), ("exit", "copy"), ("keep", "copy"),
                                    ("record", "copy"), ("wait_event", "compute")]
    assert torch.equal(dst, src) and s.stats.uploads == 1 and s.stats.downloads == 2


def _resume_ranks(rank, world, path):
    """Stage 3 with parameters and optimizer in host memory, staging forced: train straight,
    and train, save, load into a fresh engine, train on: equal; the checkpoint loads into a
    plain stage-1 engine too."""
    staging_mod.FORCE_CROSSING = True
    zo = {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_param": {"device": "cpu"},
          "offload_optimizer": {"device": "cpu"}}

    out = straight_and_resumed(zo, rank, world, path, 4, {"lr": 1e-2, "fused": False})
    staging_mod.FORCE_CROSSING = False
    return out


@pytest.mark.timeout(150)
def test_host_parameter_tier_checkpoint_resumes_exactly_on_two_ranks(tmp_path):
    from tests.dist_harness import run_ranks

    for straight, resumed, first, plain in run_ranks(_resume_ranks, 2, str(tmp_path), timeout=140):
        for k in straight:
            assert (straight[k] == resumed[k]).all(), k  # the harness returns numpy arrays
            assert (first[k] == plain[k]).all(), k
