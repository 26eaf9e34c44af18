"""A CIFAR-10 training script in the style of DeepSpeedExamples' ``training/cifar``:
the small CNN, ``deepspeed.initialize(training_data=...)`` with its loader, Adam with
weight decay, WarmupLR, gradient clipping; synthetic CIFAR-shaped data.

    torchrun --nproc_per_node N cifar_ds.py --stage S [--steps 20] [--dtype fp32|bf16]
        [--dynamic-batching] [--offload-states]

The last two are what DeepSpeedExamples' ``data_efficiency/variable_batch_size_and_lr``
and ``offload_states`` do, which zeal refuses by design: DeepSpeed's
``data_efficiency.data_sampling.dynamic_batching`` section, and ``engine.offload_states()``
/ ``reload_states()`` between steps (zeal's offload is configured, not toggled)."""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from _side import Recorder, images, import_deepspeed

deepspeed = import_deepspeed()


class Net(nn.Module):
    def __init__(self, args) -> None:
        super().__init__()
        self.moe = args.moe
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        if self.moe:  # as the example's --moe: experts replacing fc3, then a classifier
            fc3 = nn.Linear(84, 84)
            self.moe_layer_list = nn.ModuleList([
                deepspeed.moe.layer.MoE(hidden_size=84, expert=fc3, num_experts=n, ep_size=args.ep_world_size,
                                        use_residual=False, k=args.top_k, min_capacity=args.min_capacity,
                                        noisy_gate_policy=None) for n in args.num_experts])
            self.fc4 = nn.Linear(84, 10)
        else:
            self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        if self.moe:
            for layer in self.moe_layer_list:
                x, _, _ = layer(x)
            return self.fc4(x)
        return self.fc3(x)


def create_moe_param_groups(model):
    """The example's grouping: expert parameters in their own group."""
    groups = {"params": [p for p in model.parameters()], "name": "parameters"}
    return deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer(groups)


def ds_config(args) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": args.accum,
        "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                 "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                     "warmup_num_steps": args.warmup, "warmup_type": "log"}},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": args.dtype == "bf16"},
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": args.stage, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000,
                              "overlap_comm": True, "contiguous_gradients": True},
    } | ({"data_efficiency": {"enabled": True, "seed": 0, "data_sampling": {
        "enabled": True, "num_workers": 0,
        "dynamic_batching": {"enabled": True, "lr_scaling_method": "linear", "min_batch_size": 1,
                             "max_batch_size": 8, "sequence_picking_order": "dataloader",
                             "max_tokens": 8 * 3 * 32 * 32, "samples_per_batch": 8,
                             "verbose": False}}}} if args.dynamic_batching else {})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--moe", action="store_true")
    p.add_argument("--num-experts", type=int, nargs="+", default=[2])
    p.add_argument("--ep-world-size", type=int, default=1)
    p.add_argument("--top-k", type=int, default=1)
    p.add_argument("--min-capacity", type=int, default=0)
    p.add_argument("--dynamic-batching", action="store_true")
    p.add_argument("--offload-states", action="store_true")
    p.add_argument("--local_rank", type=int, default=-1)
    args = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(42)
    net = Net(args)
    trainset = images(512)
    params = create_moe_param_groups(net) if args.moe else net.parameters()
    engine, _, trainloader, _ = deepspeed.initialize(args=args, model=net, model_parameters=params,
                                                     training_data=trainset, config=ds_config(args))
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    rec = Recorder(engine.global_rank)
    step, micro = 0, 0
    while step < args.steps:
        for inputs, labels in trainloader:
            outputs = engine(inputs.to(dtype))
            loss = F.cross_entropy(outputs.float(), labels)
            engine.backward(loss)
            engine.step()
            micro += 1
            if micro % args.accum == 0:
                rec.step(loss.item())
                step += 1
                if args.offload_states and step == args.steps // 2:  # as offload_states.py between steps
                    engine.offload_states()
                    engine.reload_states()
                if step >= args.steps:
                    break
    rec.finish()


if __name__ == "__main__":
    main()
