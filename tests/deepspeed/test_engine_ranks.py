"""DeepSpeed's engine, comm and groups on real gloo ranks (1 and 2), and a pipeline script
with no ``pipeline_parallel`` section trained as a pipeline, checked against plain torch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.dist_harness import RankPool

pytestmark = pytest.mark.timeout(300)

_POOLS: dict[int, RankPool] = {}


@pytest.fixture(scope="module")
def pool():
    yield lambda world: _POOLS.setdefault(world, RankPool(world))
    for p in _POOLS.values():
        p.close()
    _POOLS.clear()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _api_rank(rank: int, world: int) -> dict:
    from zeal.deepspeed.switch import install

    install()
    import deepspeed
    import deepspeed.comm as dist
    import torch.distributed
    from deepspeed.utils import groups

    deepspeed.init_distributed(dist_backend="nccl")  # nccl without CUDA becomes gloo, as DeepSpeed's CPU runs
    out = {"torch_rank": torch.distributed.get_rank(), "world": dist.get_world_size(), "backend": dist.get_backend(),
           "local_rank": dist.get_local_rank(), "initialized": dist.is_initialized()}
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    out["all_reduce"] = t.item()
    b = torch.tensor([float(rank)])
    dist.broadcast(b, src=world - 1)
    out["broadcast"] = b.item()
    rs = torch.zeros(1)
    dist.reduce_scatter_tensor(rs, torch.arange(world, dtype=torch.float32) + 1)
    out["reduce_scatter"] = rs.item()
    dist.barrier()
    out["groups_before"] = groups._get_data_parallel_world_size()

    torch.manual_seed(0)
    model = Net()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "steps_per_print": 1000,
           "zero_optimization": {"stage": 2, "reduce_bucket_size": 12345}}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    out.update(is_module=isinstance(engine, nn.Module) and not isinstance(engine, deepspeed.PipelineEngine), names=[n for n, _ in engine.named_parameters()],
               n_params=sum(p.numel() for p in engine.parameters()), buffers=[n for n, _ in engine.named_buffers()],
               bf16=engine.bfloat16_enabled(), fp16=engine.fp16_enabled(), dp=engine.dp_world_size,
               mp=engine.mp_world_size, clip=engine.gradient_clipping(), stage=engine.zero_optimization_stage(),
               batch_info=engine.get_batch_info(), bucket=engine.zero_reduce_bucket_size(),
               partition_grads=engine.zero_optimization_partition_gradients(), opt_name=engine.optimizer_name(),
               monitor=engine.monitor.enabled, same_device=engine.to(engine.device) is engine,
               groups_after=groups._get_data_parallel_world_size(), loss_scale=engine.loss_scale())
    engine.eval()
    out["eval_mode"] = (engine.training, engine.module.training)
    engine.train()
    out["train_mode"] = (engine.training, engine.module.training)
    boundaries = []
    for micro in range(4):
        g = torch.Generator().manual_seed(10 * micro + rank)
        x, y = torch.randn(2, 6, generator=g), torch.randn(2, 3, generator=g)
        boundaries.append(engine.is_gradient_accumulation_boundary())
        loss = nn.functional.mse_loss(engine(x), y)
        assert engine.backward(loss) is loss
        engine.step()
    out.update(boundaries=boundaries, global_steps=engine.global_steps, applied=engine.was_step_applied(),
               grad_norm=engine.get_global_grad_norm(), tput=engine.tput_timer.avg_samples_per_sec())
    sd = engine.state_dict()
    out["sd_keys"] = sorted(sd)
    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        before = engine(x).clone()
    for _ in range(2):
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    with torch.no_grad():
        moved = not torch.allclose(engine(x), before)
    engine.load_state_dict(sd)
    with torch.no_grad():
        out["restored"] = moved and torch.allclose(engine(x), before, atol=1e-6)
    engine.set_train_batch_size(2 * world * 4)
    out["gas_after_set"] = engine.gradient_accumulation_steps()
    refusals = {}
    for name in ("no_sync", "get_compile_time", "is_deepcompile_enabled", "half", "deepspeed_io"):
        try:
            getattr(engine, name)
            refusals[name] = "no error"
        except NotImplementedError as e:
            refusals[name] = str(e)
    out["refusals"] = refusals
    out["hasattr_no_sync"] = hasattr(engine, "no_sync")
    try:
        _ = engine.not_a_name
    except AttributeError as e:
        out["plain_attr_error"] = type(e).__name__ if not isinstance(e, NotImplementedError) else "refused"
    engine.destroy()
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_comm_engine_and_groups_behave_as_deepspeeds(pool, world):
    results = pool(world).run(_api_rank, timeout=240)
    for rank, r in enumerate(results):
        assert r["torch_rank"] == rank and r["world"] == world and r["initialized"] and r["backend"] == "gloo"
        assert r["local_rank"] == rank and r["all_reduce"] == world * (world + 1) / 2 and r["broadcast"] == world - 1
        assert r["reduce_scatter"] == world * (rank + 1) and r["groups_before"] == world
        assert r["is_module"] and r["names"] == ["module.fc1.weight", "module.fc1.bias", "module.fc2.weight",
                                                 "module.fc2.bias"]
        assert r["n_params"] == 6 * 8 + 8 + 8 * 3 + 3 and r["buffers"] == ["module.calls"]
        assert (r["bf16"], r["fp16"], r["dp"], r["mp"], r["clip"], r["stage"]) == (False, False, world, 1, 0.5, 2)
        assert tuple(r["batch_info"]) == (4 * world, 2, 2) and r["bucket"] == 12345 and r["partition_grads"]
        assert r["opt_name"] == "AdamW" and r["monitor"] is False and r["same_device"] and r["groups_after"] == world
        assert r["loss_scale"] == 0.0
        assert r["eval_mode"] == (False, False) and r["train_mode"] == (True, True)
        assert r["boundaries"] == [False, True, False, True] and r["global_steps"] == 2 and r["applied"]
        assert r["grad_norm"] > 0 and r["tput"] > 0
        assert r["sd_keys"] == ["module.calls", "module.fc1.bias", "module.fc1.weight", "module.fc2.bias",
                                "module.fc2.weight"]
        assert r["restored"] and r["gas_after_set"] == 4
        for name, msg in r["refusals"].items():
            assert msg.startswith(f"DeepSpeedEngine.{name} (DeepSpeed 0.19) is not supported by zeal: "), msg
            assert "\n" not in msg
        assert not r["hasattr_no_sync"] and r["plain_attr_error"] == "_NotDeepSpeed"


# -- a pipeline: PipelineModule(num_stages=2), no pipeline_parallel section ---------------------
_CFG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.0}}}


def _layers() -> list[nn.Module]:
    torch.manual_seed(0)  # the same values on every rank and in the reference
    return [nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 16),
            nn.ReLU(inplace=True), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)]  # stage 1 starts in place


def _batches(step: int, n: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    return [(torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(n)]


class _Data(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(1000 + i)
        return torch.randn(8, generator=g), torch.randint(0, 4, (), generator=g)


def _pipe_rank(rank: int, world: int, steps: int) -> dict:
    from zeal.deepspeed.switch import install

    install()
    import deepspeed
    from deepspeed.pipe import PipelineModule

    model = PipelineModule(layers=_layers(), loss_fn=nn.CrossEntropyLoss(), num_stages=2, partition_method="uniform")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()],
                                           training_data=_Data(), config=_CFG)
    losses = [float(engine.train_batch(iter(_batches(s)))) for s in range(steps)]
    ev = float(engine.eval_batch(iter(_batches(99))))
    no_iter = float(engine.train_batch())  # from the training_data loader
    out = {"losses": losses, "eval": ev, "no_iter": no_iter, "is_pipe": isinstance(engine, deepspeed.PipelineEngine), "stages": engine.num_stages, "stage": engine.stage_id,
           "first_layer": type(engine.module.layers[4]).__name__, "global_steps": engine.global_steps}
    engine.destroy()
    return out


def test_pipeline_module_without_a_pipeline_section_trains_as_a_pipeline(pool):
    steps = 3
    results = pool(2).run(_pipe_rank, steps, timeout=240)
    ref = nn.Sequential(*_layers())
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    expect = []
    for s in range(steps):
        opt.zero_grad()
        total = 0.0
        for x, y in _batches(s):
            loss = nn.functional.cross_entropy(ref(x), y)
            (loss / 2).backward()
            total += loss.item() / 2
        opt.step()
        expect.append(total)
    with torch.no_grad():
        ref.eval()
        expect_eval = sum(nn.functional.cross_entropy(ref(x), y).item() for x, y in _batches(99)) / 2
    for rank, r in enumerate(results):
        assert r["stages"] == 2 and r["stage"] == rank and r["global_steps"] == steps + 1 and r["is_pipe"]
        assert r["losses"] == pytest.approx(expect, rel=1e-5) and r["eval"] == pytest.approx(expect_eval, rel=1e-5)
        assert r["no_iter"] == r["no_iter"] and r["no_iter"] > 0
    assert results[1]["first_layer"] == "ReLU"  # the stage that starts with nn.ReLU(inplace=True) ran
