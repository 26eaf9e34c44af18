"""LoRA under pipeline parallelism: a zeal Llama cut into 2 stages on 2 gloo ranks (GPipe,
activation checkpointing in each stage, ZeRO 1, gradient clipping) trains its adapters
with the losses of plain PyTorch in one process (the same apply-step on the whole model,
M micro-batches accumulated, ``clip_grad_norm_``, AdamW); ``save_adapter`` assembles the
adapters of both stages into one PEFT folder equal to the reference's trained factors.

Tolerance: losses 1e-5 absolute, as tests/pipe/test_pipeline_equivalence.py (the
stages' summation order differs); factors 1e-5 absolute."""

from __future__ import annotations

import pytest
import torch

from tests.dist_harness import run_ranks
from tests.pipe.test_pipeline_equivalence import CLIP, LR, MICRO, M, T, _data, _llama

STEPS, SEED = 3, 5
LORA = {"enabled": True, "r": 2, "alpha": 4, "target_modules": "all-linear", "init": "gaussian"}


def _reference() -> tuple[list[float], dict]:
    from zeal.config.lora import LoraConfig
    from zeal.lora.apply import apply_lora

    torch.manual_seed(0)
    model = _llama()
    apply_lora(model, LoraConfig(**LORA), SEED)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.1)
    x, _ = _data(1)
    losses = []
    for s in range(STEPS):
        total = 0.0
        for m in range(M):
            xb = x[s, m].reshape(-1, T)
            loss = model(xb, xb)
            (loss / M).backward()
            total += loss.item() / M
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}


def _train(rank: int, world: int, folder: str) -> list[float]:
    import zeal

    torch.manual_seed(0)
    cfg = {"activation_checkpointing": {}, "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": M,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}}, "seed": SEED,
           "gradient_clipping": CLIP, "zero_optimization": {"stage": 1}, "lora": dict(LORA),
           "pipeline_parallel": {"size": 2, "micro_batches": M, "schedule": "gpipe"}}
    engine = zeal.initialize(_llama(), cfg)
    assert all(".lora_" in n for n, p in engine.module.named_parameters() if p.requires_grad)
    x, _ = _data(1)
    losses = [float(engine.train_batch(iter([(x[s, m, 0], x[s, m, 0]) for m in range(M)]))) for s in range(STEPS)]
    engine.save_adapter(folder)
    engine.close()
    return losses


@pytest.mark.timeout(120)
def test_lora_pp2_equals_one_process(tmp_path):
    from zeal.lora.peft_folder import read_adapter

    ref_losses, ref_state = _reference()
    for losses in run_ranks(_train, 2, str(tmp_path), timeout=100):
        assert losses == pytest.approx(ref_losses, abs=1e-5, rel=0)
    saved = read_adapter(str(tmp_path))
    assert 2 * len(saved.lora) == len(ref_state)  # both stages' adapters
    for m, pair in saved.lora.items():
        torch.testing.assert_close(pair.A, ref_state[f"{m}.lora_A.weight"], rtol=0, atol=1e-5)
        torch.testing.assert_close(pair.B, ref_state[f"{m}.lora_B.weight"], rtol=0, atol=1e-5)
