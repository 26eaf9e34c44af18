"""ZealTrainer: Hugging Face's Trainer training through zeal's engine."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from tests.needs import needs

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

# accelerate: Trainer needs it. transformers' Trainer and zeal's are imported by the tests that
# use them, not while every worker collects the suite (~1.5 s each).
pytestmark = needs("accelerate", "transformers")

AUTO_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
}


class TokenData(torch.utils.data.Dataset):
    """Random token sequences, labels = inputs."""

    def __init__(self, n: int = 16, seq: int = 8, vocab: int = 64) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_llama() -> LlamaForCausalLM:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    return LlamaForCausalLM(cfg)


def args(tmp_path, name: str, **kw) -> TrainingArguments:
    from transformers import TrainingArguments

    base = dict(output_dir=str(tmp_path / name), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                learning_rate=1e-2, max_steps=4, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                seed=0, dataloader_num_workers=0)
    base.update(kw)
    return TrainingArguments(**base)


def losses(trainer: Trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("samples,steps", [(16, 4), (10, 6)])
def test_stage0_matches_plain_trainer(tmp_path, samples, steps):
    """10 samples in batches of 2 with accumulation 2: every epoch ends with a one-batch
    update, which the engine must make where Trainer makes it."""
    from transformers import Trainer

    from zeal.integrations.transformers import ZealTrainer

    ds = TokenData(n=samples)
    plain = Trainer(model=tiny_llama(), args=args(tmp_path, "plain", max_steps=steps), train_dataset=ds)
    plain.train()
    cfg = dict(AUTO_CONFIG, zero_optimization={"stage": 0})
    zt = ZealTrainer(model=tiny_llama(), args=args(tmp_path, "zeal", max_steps=steps), train_dataset=ds,
                     zeal_config=cfg)
    zt.train()
    want, got = losses(plain), losses(zt)
    assert len(want) == len(got) == steps
    assert got == pytest.approx(want, rel=1e-5)
    lrs = [[h["learning_rate"] for h in t.state.log_history if "loss" in h] for t in (plain, zt)]
    assert lrs[1] == pytest.approx(lrs[0], rel=1e-6)
    assert zt.zeal_engine.global_steps == steps


@pytest.mark.timeout(300)
def test_stage3_trains_and_saves_hf_model(tmp_path):
    from transformers import LlamaForCausalLM

    from zeal.integrations.transformers import ZealTrainer

    ds = TokenData()
    cfg = dict(AUTO_CONFIG, zero_optimization={"stage": 3})
    zt = ZealTrainer(model=tiny_llama(), args=args(tmp_path, "z3", max_steps=8, learning_rate=3e-2,
                                                   lr_scheduler_type="constant"),
                     train_dataset=ds, zeal_config=cfg)
    zt.train()
    got = losses(zt)
    assert len(got) == 8 and got[-1] < got[0]
    out = tmp_path / "saved"
    zt.save_model(str(out))
    state = zt.zeal_engine.module_state_dict()
    reloaded = LlamaForCausalLM.from_pretrained(str(out)).eval()
    init = tiny_llama().state_dict()
    assert any(not torch.equal(v, init[k]) for k, v in reloaded.state_dict().items())  # trained weights
    ref = tiny_llama().eval()
    ref.load_state_dict(state)
    x = ds.ids[:2]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x).logits, ref(x).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(300)
def test_checkpoint_resume_continues_the_run(tmp_path):
    from zeal.integrations.transformers import ZealTrainer

    ds = TokenData()
    cfg = dict(AUTO_CONFIG, zero_optimization={"stage": 2})
    full = ZealTrainer(model=tiny_llama(), args=args(tmp_path, "full", max_steps=6), train_dataset=ds,
                       zeal_config=cfg)
    full.train()
    first = ZealTrainer(model=tiny_llama(), args=args(tmp_path, "run", max_steps=6, save_strategy="steps",
                                                      save_steps=3), train_dataset=ds, zeal_config=cfg)
    first.train()
    ckpt = tmp_path / "run" / "checkpoint-3"
    assert (ckpt / "trainer_state.json").exists() and (ckpt / "latest").exists()
    resumed = ZealTrainer(model=tiny_llama(), args=args(tmp_path, "run", max_steps=6), train_dataset=ds,
                          zeal_config=cfg)
    resumed.train(resume_from_checkpoint=str(ckpt))
    after = [h["loss"] for h in resumed.state.log_history if "loss" in h and h["step"] > 3]
    assert len(after) == 3
    assert after == pytest.approx(losses(full)[3:], rel=1e-5)


def _train_and_eval(rank: int, world: int, stage: int, out: str) -> tuple[list[float], float]:
    """ZealTrainer on ``world`` ranks with the same global batch (8 = every sample, so the
    order a sampler picks does not matter), then evaluate() through the engine."""
    from zeal.integrations.transformers import ZealTrainer

    bs = 8 // (2 * world)
    zt = ZealTrainer(model=tiny_llama(), args=args(Path(out), f"w{world}", per_device_train_batch_size=bs),
                     train_dataset=TokenData(n=8), zeal_config=dict(AUTO_CONFIG, zero_optimization={"stage": stage}))
    zt.train()
    return losses(zt), zt.evaluate(TokenData(n=8, seq=8))["eval_loss"]


@pytest.mark.timeout(300)
def test_two_ranks_match_one_rank_stage3(tmp_path):
    """Trainer under torchrun: accelerate must not wrap the model in DDP (the weights would
    stop updating), the data is split over the ranks and evaluation gathers stage-3 shards."""
    from tests.dist_harness import run_ranks

    want, want_eval = _train_and_eval(0, 1, 3, str(tmp_path))
    got = run_ranks(_train_and_eval, 2, 3, str(tmp_path), timeout=240)
    assert want[-1] < want[0]
    for got_losses, got_eval in got:
        assert got_losses == pytest.approx(want, rel=1e-5)
        assert got_eval == pytest.approx(want_eval, rel=1e-5)
