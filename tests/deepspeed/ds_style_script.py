"""A training script written the way DeepSpeed users write one; the only change is the
import line (``import deepspeed`` → ``import zeal.deepspeed as deepspeed``)."""

import os

import torch
import torch.nn.functional as F
from torch import nn

import zeal.deepspeed as deepspeed  # was: import deepspeed


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(deepspeed.checkpointing.checkpoint(self.fc1, x)))


def batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(2, 16, generator=g), torch.randn(2, 4, generator=g)


def train_steps(model_engine, first, n):
    losses = []
    for step in range(first, first + n):
        for micro in range(model_engine.gradient_accumulation_steps()):
            x, y = batch(2 * step + micro, model_engine.global_rank)
            loss = F.mse_loss(model_engine(x.to(model_engine.device)), y.to(model_engine.device))
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
    return losses


def main(ds_config, out_dir):
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = Net()
    model_engine, optimizer, _, lr_scheduler = deepspeed.initialize(
        args=None, model=model, model_parameters=model.parameters(), config=ds_config)

    first = train_steps(model_engine, 0, 3)
    model_engine.save_checkpoint(out_dir, tag="step3", client_state={"step": 3})
    after = train_steps(model_engine, 3, 2)
    path, client_state = model_engine.load_checkpoint(out_dir, tag="step3")
    replay = train_steps(model_engine, 3, 2)

    with deepspeed.zero.GatheredParameters(list(model_engine.module.fc2.parameters()), modifier_rank=0):
        if model_engine.global_rank == 0:
            model_engine.module.fc2.bias.data.fill_(0.5)
    with deepspeed.zero.GatheredParameters(model_engine.module.fc2.bias):
        bias = model_engine.module.fc2.bias.detach().float().clone()

    model_engine.save_16bit_model(out_dir, "model.bin")
    return {
        "first": first, "after": after, "replay": replay, "path": path, "client_state": client_state,
        "bias": bias, "global_steps": model_engine.global_steps, "lr": model_engine.get_lr(),
        "stage": model_engine.zero_optimization_stage(), "boundary": model_engine.is_gradient_accumulation_boundary(),
        "train_batch_size": model_engine.train_batch_size(), "module": type(model_engine.module).__name__,
        "optimizer": type(optimizer).__name__, "scheduler": type(lr_scheduler).__name__,
        "saved": sorted(os.listdir(out_dir)),
    }
