"""A DeepSpeed-Chat-style script of steps 1-3 (``scripts/dschat_style.py``: DS-Chat's
DeepSpeed calls, a tiny OPT) run unchanged under ``zeal deepspeed`` on gloo ranks. Step 1's
per-rank losses are checked against one process of plain torch (AdamW over the same
groups, the same cosine schedule, clipping, the ranks' batches averaged); steps 2 and 3
run end to end (reward model; PPO with the hybrid engine's ``module.generate``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist_harness import free_port

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "dschat_style.py"


def _run(tmp_path: Path, ranks: int, *args: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("ZEAL_DEEPSPEED", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "zeal.cli.main", "deepspeed", "--num_gpus", str(ranks),
                          "--master_port", str(free_port()), str(SCRIPT), "--out", str(tmp_path), *args],
                         env=env, capture_output=True, text=True, timeout=560)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(ranks)]


def _sft_reference(world: int, samples: int = 8, micro: int = 2) -> list[list[float]]:
    """Step 1 in one process: per step, every rank's batch, the mean loss's gradient."""
    from torch.utils.data import DistributedSampler
    from transformers import AutoModelForCausalLM, OPTConfig, get_scheduler

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(OPTConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=32, pad_token_id=1, bos_token_id=2, eos_token_id=2,
        dropout=0.0, attention_dropout=0.0))
    no_decay = ("bias", "layer_norm.weight")
    groups = [{"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
               "weight_decay": 0.1},
              {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)],
               "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=5e-3, betas=(0.9, 0.95), eps=1e-8)
    g = torch.Generator().manual_seed(1)
    ids_all = torch.randint(3, 64, (samples, 12), generator=g)
    ds = torch.utils.data.TensorDataset(ids_all, torch.ones_like(ids_all))
    orders = [list(DistributedSampler(ds, num_replicas=world, rank=r)) for r in range(world)]
    steps = len(orders[0]) // micro
    sched = get_scheduler("cosine", optimizer=opt, num_warmup_steps=0, num_training_steps=steps)
    losses: list[list[float]] = [[] for _ in range(world)]
    for s in range(steps):
        total = 0.0
        for r in range(world):
            ids = ds.tensors[0][orders[r][s * micro:(s + 1) * micro]]
            loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, use_cache=False).loss
            losses[r].append(loss.item())
            total = total + loss / world
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sched.step()
    return losses


def _check(recs: list[dict], world: int) -> None:
    ref = _sft_reference(world)
    for r, rec in enumerate(recs):
        assert rec["world"] == world and rec["rank"] == r == rec["comm_rank"]
        # fp32, the same math in another summation order (ranks' reductions): float32 rounding
        assert rec["step1"]["losses"] == pytest.approx(ref[r], rel=1e-5)
        assert rec["step1"]["layers"] == 2 and rec["step1"]["epochs"] == 1
        s2 = rec["step2"]
        assert len(s2["losses"]) == len(s2["acc"]) > 0 and all(v == v for v in s2["losses"])
        s3 = rec["step3"]
        assert s3["actor_type"] == "DeepSpeedHybridEngine"
        assert s3["modes"] == [[False, False], [True, True]] * len(s3["actor_loss"])  # eval() / train() toggles
        for seqs in s3["generated"]:  # prompt kept, answer generated up to max_length
            assert all(len(s) == 12 for s in seqs)
        assert all(v == v for v in s3["actor_loss"] + s3["critic_loss"])
    assert len({rec["step3"]["actor_norm"] for rec in recs}) == 1  # one actor on every rank


def test_dschat_style_steps_1_to_3_two_ranks_zero2(tmp_path):
    _check(_run(tmp_path, 2, "--stage", "2"), 2)


@pytest.mark.slow
@pytest.mark.parametrize("ranks,stage", [(2, 3), (1, 0), (1, 3)])
def test_dschat_style_steps_1_to_3_slow(tmp_path, ranks, stage):
    _check(_run(tmp_path, ranks, "--stage", str(stage)), ranks)


@pytest.mark.slow
def test_dschat_style_bf16_offload_runs(tmp_path):
    recs = _run(tmp_path, 2, "--stage", "2", "--dtype", "bf16", "--offload")
    assert all(rec["step3"]["actor_type"] == "DeepSpeedHybridEngine" for rec in recs)
