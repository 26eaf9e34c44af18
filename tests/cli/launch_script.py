"""Run by tests/cli/test_launch.py under `zeal launch`: a plain all_reduce, then a
few ZeRO-3 fp32 steps of a tiny GPT through zeal; rank 0 writes what it saw."""

import json
import sys

import torch
import torch.distributed as dist

import zeal
from zeal.models import GPT, GPTConfig

torch.manual_seed(0)
engine = zeal.initialize(
    GPT(GPTConfig(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)),
    {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
     "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "gradient_clipping": 1.0, "seed": 5})
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.arange(4, dtype=torch.float64) * (rank + 1)
dist.all_reduce(t)
losses = []
for _ in range(3):  # the same batch each step: the loss must fall
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank))
    loss = engine({"input_ids": x, "labels": x})
    engine.backward(loss)
    engine.step()
    mean = loss.detach().double().reshape(1)
    dist.all_reduce(mean)
    losses.append(mean.item() / world)
state = engine.module_state_dict()
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"world": world, "all_reduce": t.tolist(), "losses": losses,
                   "param_sum": sum(float(v.double().sum()) for v in state.values())}, f)
