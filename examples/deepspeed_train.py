"""A training script written for DeepSpeed, run on zeal without changing a line: under
``zeal deepspeed`` (DeepSpeed's launcher, same flags) ``import deepspeed`` and every
``deepspeed.*`` module resolve to zeal's implementation.

    zeal deepspeed --num_gpus 2 examples/deepspeed_train.py --deepspeed   # 2 ranks, ZeRO stage 2, ~10 s
    python -m zeal.deepspeed examples/deepspeed_train.py --deepspeed       # one process, ranks started elsewhere
    python -m zeal.deepspeed examples/deepspeed_train.py --toy             # 4 steps (what CI runs)

With ``--deepspeed_config ds_config.json`` the config comes from a file, as in DeepSpeed;
without it the script passes the dict below. The same file runs under DeepSpeed itself
(``deepspeed --num_gpus 2 examples/deepspeed_train.py --deepspeed``).
"""
import argparse

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.utils import set_random_seed
from deepspeed.utils import RepeatingLoader

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--toy", action="store_true", help="4 steps (what CI runs)")
parser = deepspeed.add_config_arguments(parser)  # --deepspeed, --deepspeed_config
args = parser.parse_args()
steps = 4 if args.toy else args.steps

deepspeed.init_distributed()                     # joins the launcher's ranks (alone: a one-process group)
set_random_seed(0)
config = None if args.deepspeed_config else {
    "train_micro_batch_size_per_gpu": 16,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 3e-3}},
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2},
    "steps_per_print": 50,
}
# a task with a known answer: which of 4 quadrants a 2-d point falls in (plus 14 noise features)
gen = torch.Generator().manual_seed(1)
x = torch.randn(4096, 16, generator=gen)
y = (x[:, 0] > 0).long() * 2 + (x[:, 1] > 0).long()
data = torch.utils.data.TensorDataset(x, y)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))

engine, optimizer, loader, scheduler = deepspeed.initialize(
    args=args, model=model, model_parameters=model.parameters(), training_data=data, config=config)
device = get_accelerator().device_name(engine.local_rank)
for step, (xb, yb) in zip(range(steps), RepeatingLoader(loader)):
    loss = torch.nn.functional.cross_entropy(engine(xb.to(device)), yb.to(device))
    engine.backward(loss)
    engine.step()
    if engine.global_rank == 0 and (step % 25 == 0 or step == steps - 1):
        print(f"micro-step {step}: loss {loss.item():.4f} lr {engine.get_lr()[0]:.2e}")

engine.eval()
with torch.no_grad():
    accuracy = (engine(x[:512].to(device)).argmax(-1) == y[:512].to(device)).float().mean().item()
engine.save_checkpoint("runs/example-deepspeed")  # every rank writes its shard
if engine.global_rank == 0:
    print(f"accuracy {accuracy:.3f}; ZeRO stage {engine.zero_optimization_stage()}, "
          f"{engine.dp_world_size} rank(s); checkpoint in runs/example-deepspeed")
