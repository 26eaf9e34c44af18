"""FLOPs: the ``flops_profiler`` section's count of a training step against the analytic
6·N·T + attention (zeal's GPT and Llama, within 2 %), its report, and the per-step
``tflops`` / ``mfu`` figures' formula."""

from __future__ import annotations

import pytest
import torch

from zeal.utils.flops import flops_per_token, matmul_weights, peak_flops

SEQ, MICRO = 32, 2


def _gpt():
    from zeal.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4))


def _llama():
    from zeal.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def _profiled(model, extra: dict | None = None, tmp_path=None):
    import zeal
    from zeal.train.flops_profiler import FlopsProfiler

    section = {"enabled": True, "profile_step": 2, "module_depth": -1, "top_modules": 2}
    if tmp_path is not None:
        section["output_file"] = str(tmp_path / "flops.txt")
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "flops_profiler": section,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}} | (extra or {})
    engine = zeal.initialize(model, cfg)
    prof = next(h for h in engine._hooks if isinstance(h, FlopsProfiler))
    for step in range(3):
        x = torch.randint(0, 256, (MICRO, SEQ))
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        if step == 0:
            assert prof.result is None  # step 2 is profiled, not step 1
    engine.close()
    return prof.result


@pytest.mark.parametrize("make", [_gpt, _llama], ids=["gpt", "llama"])
def test_profiled_step_equals_the_analytic_count(make):
    model = make()
    expected = flops_per_token(model, SEQ) * MICRO * SEQ
    r = _profiled(model)
    assert r["flops"] == pytest.approx(expected, rel=0.02), (r["flops"], expected)
    assert r["tflops"] > 0 and r["params"] == sum(p.numel() for p in model.parameters())


def test_report_file_lists_the_top_modules(tmp_path):
    r = _profiled(_gpt(), tmp_path=tmp_path)
    text = (tmp_path / "flops.txt").read_text()
    assert "flops profiler (step 2)" in text and "TFLOP/s" in text
    depths = [m["depth"] for m in r["modules"]]
    assert all(depths.count(d) <= 2 for d in set(depths))  # top_modules per depth
    top = r["modules"][0]
    assert top["depth"] == 0 and 0.5 < top["share"] <= 1.0 and top["ops"]  # the model: most of the FLOPs


def test_flops_formula_and_peak():
    model = _gpt()
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert matmul_weights(model) == linear
    assert flops_per_token(model, SEQ) == 6 * linear + 12 * 2 * 64 * SEQ
    peak, source = peak_flops("cpu")
    assert peak > 1e8 and "measured" in source
