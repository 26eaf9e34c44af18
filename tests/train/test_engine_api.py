"""zeal's ``TrainEngine`` keeps zeal's API; DeepSpeed's accessor names live on the facade
(``zeal.deepspeed.engine.DeepSpeedEngine``), which answers them from zeal's names."""

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import zeal
from zeal.deepspeed.refusals import deepspeed_names
from zeal.train.engine import TrainEngine, live_engines

# names TrainEngine shares with DeepSpeed's engine: the loop's verbs and zeal's own reports
# (memory_breakdown / wall_clock_breakdown / loss_scale answer in zeal's terms; the facade
# gives DeepSpeed's meaning under the same names)
SHARED_WITH_DEEPSPEED = {
    "forward", "backward", "step", "train", "eval", "zero_grad", "save_checkpoint", "load_checkpoint",
    "module_state_dict", "memory_breakdown", "wall_clock_breakdown", "loss_scale",
}


def _public(cls: type) -> set[str]:
    return {k for k in dir(cls) if not k.startswith("_")}


def test_train_engine_has_no_deepspeed_accessors():
    names = deepspeed_names()
    ds = names["engine"] | names["engine_from_nn_module"]
    assert _public(TrainEngine) & ds == SHARED_WITH_DEEPSPEED
    assert len(_public(TrainEngine)) <= 30  # the engine sequences; features and facades live elsewhere


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
          "optimizer": {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}}}


def test_zeal_names_on_the_engine():
    eng = zeal.initialize(_net(), CONFIG)
    assert (eng.micro_batch, eng.grad_accum, eng.zero_stage, eng.compute_dtype) == (4, 2, 0, torch.float32)
    assert eng.token_drop is None and eng.grad_norm is None and eng.skipped_steps == 0 and eng.loss_scale == 1.0
    x, y = torch.randn(8, 8), torch.randn(8, 2)
    ref = _net()
    torch.nn.functional.mse_loss(ref(x), y).backward()  # the mean gradient over both micro-batches
    norm = torch.cat([p.grad.flatten() for p in ref.parameters()]).norm().item()
    assert not eng.at_boundary
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        eng.backward(torch.nn.functional.mse_loss(eng(xs), ys))
        eng.step()
    assert eng.global_steps == 1 and eng.grad_norm == pytest.approx(norm, rel=1e-5)
    eng.set_boundary(True)  # a short last accumulation: this micro-step ends it
    assert eng.at_boundary
    eng.close()


def test_the_batch_and_the_progress_are_set_through_the_engine():
    """What the DeepSpeed facade's set_train_(micro_)batch_size and a checkpoint load change:
    the engine's settable micro_batch / grad_accum and restore_progress (no internals)."""
    eng = zeal.initialize(_net(), CONFIG)  # micro-batch 4, 2 accumulation steps
    x, y = torch.randn(4, 8), torch.randn(4, 2)

    def micro_step():
        eng.backward(torch.nn.functional.mse_loss(eng(x), y))
        eng.step()

    micro_step()  # halfway through an accumulation
    eng.restore_progress(5, 10, 40)  # a checkpoint's counters, saved after an update
    assert (eng.global_steps, eng.micro_steps, eng.global_samples) == (5, 10, 40)
    assert not eng.at_boundary  # a new accumulation starts: the first of 2
    eng.grad_accum = 3
    micro_step()
    micro_step()
    assert eng.global_steps == 5 and eng.at_boundary  # the third of 3 ends it
    eng.micro_batch = 2
    micro_step()
    assert (eng.global_steps, eng.micro_steps, eng.global_samples) == (6, 13, 40 + 4 + 4 + 2)
    for name in ("grad_accum", "micro_batch"):
        with pytest.raises(ValueError, match=f"{name} must be >= 1, got 0"):
            setattr(eng, name, 0)
    assert (eng.grad_accum, eng.micro_batch) == (3, 2)
    assert any(e is eng for e in live_engines())  # where the facade's module-level helpers look
    eng.close()
    assert not any(e is eng for e in live_engines())


def test_deepspeed_names_on_the_facade_answer_from_zeal_names(tmp_path):
    import zeal.deepspeed as deepspeed

    ds, _, _, _ = deepspeed.initialize(model=_net(), config=dict(CONFIG), dist_init_required=False)
    z = ds.engine
    assert ds.train_micro_batch_size_per_gpu() == z.micro_batch == 4
    assert ds.gradient_accumulation_steps() == z.grad_accum == 2
    assert ds.train_batch_size() == 8 and ds.get_batch_info() == (8, 4, 2)
    assert ds.zero_optimization_stage() == 0 and ds.get_lr() == [0.5] and ds.get_mom() == [0.9]
    assert not ds.random_ltd_enabled() and ds.random_ltd_scheduler is None
    assert ds.get_global_grad_norm() is None and not ds.is_gradient_accumulation_boundary()
    for _ in range(2):
        ds.backward(ds(torch.randn(4, 8)).pow(2).mean())
        ds.step()
    assert ds.get_global_grad_norm() == z.grad_norm is not None and ds.was_step_applied()
    ds.set_gradient_accumulation_boundary(True)
    assert ds.is_gradient_accumulation_boundary() and z.at_boundary
    ds.set_train_batch_size(16)
    assert z.grad_accum == 4
    ds.set_train_micro_batch_size(2)
    assert z.micro_batch == 2 and ds.train_batch_size() == 8
    ds.save_16bit_model(str(tmp_path), "m.safetensors")
    saved = load_file(tmp_path / "m.safetensors")
    assert set(saved) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    torch.testing.assert_close(saved["0.weight"], z.module[0].weight.detach())
    ds.close()
