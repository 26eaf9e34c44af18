"""A save/resume round trip shared by the offload tiers' checkpoint tests."""

from __future__ import annotations

import torch

import zeal
from tests.train.models import TinyNet, make_batches


def straight_and_resumed(zo: dict, rank: int, world: int, path: str, steps: int, optimizer_params: dict) -> tuple:
    """TinyNet under ``zero_optimization`` ``zo`` trained ``steps`` steps straight, and trained
    half of them, saved, loaded into a fresh engine and trained on; the saved checkpoint is
    also loaded into a plain stage-1 engine. Returns the module state dicts of (straight,
    resumed, first half, plain)."""

    def engine_for(zo):
        torch.manual_seed(0)
        return zeal.initialize(TinyNet(), {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zo,
                                           "optimizer": {"type": "AdamW", "params": dict(optimizer_params)}})

    batches = make_batches(steps, 1, world, 2)

    def train(engine, steps):
        for step in steps:
            engine.backward(engine(step[0][rank]))
            engine.step()

    half = steps // 2
    straight = engine_for(zo)
    train(straight, batches)
    first = engine_for(zo)
    train(first, batches[:half])
    first.save_checkpoint(path + "/ckpt", tag="half")
    resumed = engine_for(zo)
    resumed.load_checkpoint(path + "/ckpt", tag="half")
    train(resumed, batches[half:])
    plain = engine_for({"stage": 1})  # the offloaded run's checkpoint loads into a plain engine too
    plain.load_checkpoint(path + "/ckpt", tag="half")
    return (straight.module_state_dict(), resumed.module_state_dict(), first.module_state_dict(),
            plain.module_state_dict())
