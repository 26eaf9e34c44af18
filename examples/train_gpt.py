"""Train zeal's GPT from Python: build the model, hand it to ``zeal.initialize`` with a
DeepSpeed-style config, and run the usual forward / backward / step loop.

    python examples/train_gpt.py                  # 300 steps, ~20 s on 2 CPU cores
    zeal launch --nproc 2 examples/train_gpt.py   # the same on 2 ranks: ZeRO stage 3 shards the model
    python examples/train_gpt.py --toy            # 3 steps (what CI runs)

The text is the source of Python's own ``json`` package, read as bytes (vocabulary 256).
"""
import argparse
import json
from pathlib import Path

import torch

import zeal
from zeal.models import GPT, GPTConfig

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--toy", action="store_true", help="3 steps, a short sample")
args = parser.parse_args()
steps = 3 if args.toy else args.steps

text = b"".join(p.read_bytes() for p in sorted(Path(json.__file__).parent.glob("*.py")))
data = torch.tensor(list(text), dtype=torch.long)
model = GPT(GPTConfig(vocab_size=256, n_positions=128, n_embd=128, n_layer=4, n_head=4))
engine = zeal.initialize(model, {
    "train_micro_batch_size_per_gpu": 8,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 20}},
    "zero_optimization": {"stage": 3},
})
gen = torch.Generator().manual_seed(engine.mesh.dp_rank)  # each rank its own batches
for step in range(1, steps + 1):
    starts = torch.randint(len(data) - 128, (8,), generator=gen)
    x = torch.stack([data[s:s + 128] for s in starts])
    loss = engine(x, labels=x)      # zeal's GPT returns the next-token loss when given labels
    engine.backward(loss)
    engine.step()
    if step % 50 == 0 or step == steps:
        print(f"step {step}: loss {loss.item():.3f}")

engine.eval()                       # sample through the engine (under ZeRO-3 every rank takes part)
ids = torch.tensor([list(b"def ")])
with torch.no_grad():
    for _ in range(8 if args.toy else 120):
        logits = engine(ids[:, -128:])[:, -1].float()
        ids = torch.cat([ids, torch.multinomial(torch.softmax(logits / 0.7, -1), 1)], dim=1)
if engine.mesh.rank == 0:
    print(bytes(ids[0].tolist()).decode("utf-8", errors="replace"))
