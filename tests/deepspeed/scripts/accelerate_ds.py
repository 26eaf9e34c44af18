"""An accelerate script with the DeepSpeed plugin (``Accelerator(deepspeed_plugin=...)``, or
``accelerate launch --use_deepspeed``, which sets the same plugin from the environment):
``prepare``, ``accelerator.backward``, ``optimizer.step`` / ``zero_grad`` (no-ops under
DeepSpeed), ``save_state`` / ``load_state``. Rank 0 prints ``RESULT {json}``: the per-step
losses, the losses of the same loop in plain PyTorch on one process (same init, AdamW,
clipping) and the losses after ``load_state`` of the mid-run state.

    python -m zeal.deepspeed accelerate_ds.py --out DIR [--stage 2]"""

from __future__ import annotations

import argparse
import json
import os

import torch
from accelerate import Accelerator, DeepSpeedPlugin
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--stage", type=int, default=2)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--plugin-from-env", action="store_true", help="as `accelerate launch --use_deepspeed` sets it")
a = p.parse_args()
ACCUM, MICRO = 2, 4


def model_and_data() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(256, 8, generator=g), torch.randn(256, 1, generator=g)


def reference(world: int) -> list[float]:
    """Plain PyTorch: the global batch of every step at once (the mean over ranks and micro-batches)."""
    model, x, y = model_and_data()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, per = [], MICRO * ACCUM * world
    for s in range(a.steps):
        xb, yb = x[s * per:(s + 1) * per], y[s * per:(s + 1) * per]
        # rank r's micro-batch k is rows r*MICRO*ACCUM + k*MICRO (a split-by-rank contiguous loader)
        loss = nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


plugin = None if a.plugin_from_env else DeepSpeedPlugin(zero_stage=a.stage, gradient_accumulation_steps=ACCUM,
                                                        gradient_clipping=1.0)
acc = Accelerator(deepspeed_plugin=plugin)
ds_config = acc.state.deepspeed_plugin.deepspeed_config  # no DataLoader is prepared: the sizes are ours to give
ds_config.update(train_micro_batch_size_per_gpu=MICRO, train_batch_size=MICRO * ACCUM * acc.num_processes)
model, x, y = model_and_data()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
engine, opt = acc.prepare(model, opt)
world, rank = acc.num_processes, acc.process_index


def run_steps(first: int, last: int) -> list[float]:
    per, out = MICRO * ACCUM * world, []
    for s in range(first, last):
        rows = slice(s * per + rank * MICRO * ACCUM, s * per + (rank + 1) * MICRO * ACCUM)
        total = 0.0
        for k in range(ACCUM):
            xb, yb = x[rows][k * MICRO:(k + 1) * MICRO], y[rows][k * MICRO:(k + 1) * MICRO]
            with acc.accumulate(engine):
                loss = nn.functional.mse_loss(engine(xb), yb)
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
            total += acc.reduce(loss.detach(), "mean").item() / ACCUM
        out.append(total)
    return out


half = a.steps // 2
losses = run_steps(0, half)
acc.save_state(os.path.join(a.out, "state"))
losses += run_steps(half, a.steps)
acc.load_state(os.path.join(a.out, "state"))
again = run_steps(half, a.steps)
if rank == 0:
    print("RESULT " + json.dumps({"losses": losses, "again": again, "reference": reference(world),
                                  "engine": type(engine).__module__,
                                  "stage": engine.zero_optimization_stage()}), flush=True)
