"""A DeepSpeedExamples-style CIFAR script (training/cifar's shape) on synthetic 3x32x32
images: written for DeepSpeed, run unchanged under ``zeal deepspeed``. It writes each
rank's losses and a parameter checksum to ``--out`` (a JSON per rank)."""

import argparse
import json
import os

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from deepspeed.runtime.utils import set_random_seed
from deepspeed.utils import RepeatingLoader, log_dist


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("-e", "--epochs", default=1, type=int)
    parser.add_argument("--steps", default=4, type=int)
    parser.add_argument("--moe", default=False, action="store_true")
    parser.add_argument("--num-experts", type=int, nargs="+", default=[1])
    parser.add_argument("--out", required=True)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class SyntheticCifar(torch.utils.data.Dataset):
    def __init__(self, n=64):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 3, 32, 32, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Net(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.moe = args.moe
        if args.moe:
            self.moe_layer = deepspeed.moe.layer.MoE(hidden_size=84, expert=nn.Linear(84, 84),
                                                     num_experts=args.num_experts[0], k=1)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        if self.moe:
            x, _, _ = self.moe_layer(x)
        return self.fc3(x)


def main():
    args = add_argument()
    deepspeed.init_distributed()
    set_random_seed(42)
    rank = dist.get_rank()
    assert args.local_rank == int(os.environ["LOCAL_RANK"]), (args.local_rank, os.environ["LOCAL_RANK"])
    net = Net(args)
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    if args.moe:
        parameters = split_params_into_different_moe_groups_for_optimizer(
            {"params": [p for p in net.parameters() if p.requires_grad], "name": "parameters"})
    model_engine, optimizer, trainloader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=SyntheticCifar())
    local_device = get_accelerator().device_name(model_engine.local_rank)
    target_dtype = torch.bfloat16 if model_engine.bfloat16_enabled() else (
        torch.half if model_engine.fp16_enabled() else None)
    criterion = nn.CrossEntropyLoss()
    losses = []
    data = RepeatingLoader(trainloader)
    for step in range(args.steps * model_engine.gradient_accumulation_steps()):
        inputs, labels = next(data)
        inputs, labels = inputs.to(local_device), labels.to(local_device)
        if target_dtype is not None:
            inputs = inputs.to(target_dtype)
        outputs = model_engine(inputs)
        loss = criterion(outputs.float(), labels)
        model_engine.backward(loss)
        model_engine.step()
        losses.append(loss.item())
        log_dist(f"step {step} loss {loss.item():.4f}", ranks=[0])
    with torch.no_grad():
        checksum = sum(float(v.double().sum()) for v in model_engine.module_state_dict().values())
    record = {"rank": rank, "world": dist.get_world_size(), "local_rank": args.local_rank, "losses": losses,
              "checksum": checksum, "global_steps": model_engine.global_steps,
              "dp_world_size": model_engine.dp_world_size, "params": sum(p.numel() for p in model_engine.parameters()),
              "lr": model_engine.get_lr(), "was_step_applied": model_engine.was_step_applied(),
              "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                      "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE")}}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
