"""Writes the format-1 checkpoints in this folder (``v1_*``) and what they must load as
(``v1_*.json``). It was run once, at commit 06058ab (the last commit writing format 1),
with ``PYTHONPATH=. python tests/checkpoint/data/make_v1.py``; today's code writes a
newer format, so running it again would not reproduce format-1 files.

Each case: a tiny zeal GPT (tied head, ``wpe`` frozen so that frozen parameters are
covered) trained 2 steps with Adam and WarmupLR, saved as tag ``v1``. The JSON holds,
per saved tensor, the SHA-256 of its full fp32 value (bit-exact oracle) and its sum
(diagnostics); the counters; the loss of a fixed evaluation batch on the saved model;
and the evaluation loss after one more training step (which depends on the Adam
moments and step count).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
GPT_CFG = {"vocab_size": 32, "n_positions": 8, "n_embd": 8, "n_layer": 1, "n_head": 2}
MICRO, SEQ = 2, 8
CASES = {"v1_w2s2": (2, 2), "v1_w2s3": (2, 3), "v1_w1s1": (1, 1)}


def config(stage: int, world: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 2 // world,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 1e-2}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                  "reduce_bucket_size": 500}}


def model():
    from zeal.models import GPT, GPTConfig

    torch.manual_seed(0)
    m = GPT(GPTConfig(**GPT_CFG))
    m.transformer.wpe.weight.requires_grad_(False)
    return m


def batch(step: int, part: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``part`` (0 or 1) of global step ``step``: the same on any world size."""
    g = torch.Generator().manual_seed(1000 * step + part)
    x = torch.randint(0, GPT_CFG["vocab_size"], (MICRO, SEQ), generator=g)
    return x, x


def train_step(engine, step: int, rank: int, world: int) -> None:
    """One optimizer step on the 2 micro-batches of ``step`` (split over ranks or accumulated)."""
    for part in range(2):
        if part % world == rank:
            loss = engine(batch(step, part))
            engine.backward(loss)
            engine.step()


def eval_loss(engine) -> float:
    with torch.no_grad():
        return float(engine(batch(99, 0)))


def tensor_digest(t: torch.Tensor) -> dict:
    t = t.detach().to(torch.float32).contiguous()
    return {"sha256": hashlib.sha256(t.numpy().tobytes()).hexdigest(), "sum": float(t.double().sum()),
            "shape": list(t.shape)}


def _write(rank: int, world: int, stage: int, root: str) -> dict:
    import zeal

    engine = zeal.initialize(model(), config(stage, world))
    for s in range(2):
        train_step(engine, s, rank, world)
    engine.save_checkpoint(root, tag="v1", client_state={"note": "format 1", "t": torch.arange(3)})
    loss0 = eval_loss(engine)
    train_step(engine, 2, rank, world)
    return {"eval_loss": loss0, "eval_loss_after_step": eval_loss(engine),
            "counters": [engine.global_steps, engine.micro_steps, engine.global_samples]}


def main() -> None:
    sys.path.insert(0, str(HERE.parents[2]))
    from tests.train.test_checkpoint import assemble  # the format-1 reader, checked by its own tests

    from tests.dist_harness import run_ranks

    for name, (world, stage) in CASES.items():
        root = HERE / name
        shutil.rmtree(root, ignore_errors=True)
        if world == 1:
            res = [_write(0, 1, stage, str(root))]
        else:
            res = run_ranks(_write, world, stage, str(root), timeout=120)
        full = assemble(root / "v1")
        expected = {
            "world_size": world, "zero_stage": stage, "gpt": GPT_CFG, "counters": res[0]["counters"],
            "eval_loss": res[0]["eval_loss"], "eval_loss_after_step": res[0]["eval_loss_after_step"],
            "tensors": {k: tensor_digest(v) for k, v in sorted(full.items()) if not k.startswith("scalar.")},
            "scalars": {k: float(v) for k, v in sorted(full.items()) if k.startswith("scalar.")},
        }
        (HERE / f"{name}.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
        print(name, sum(f.stat().st_size for f in root.rglob("*") if f.is_file()), "bytes")


if __name__ == "__main__":
    main()
