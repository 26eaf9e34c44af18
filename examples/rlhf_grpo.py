"""Reinforcement learning from a reward you write: GRPO on the embedded
SmolLM2-135M-Instruct, rewarded for answering sums correctly with the number alone. Rollouts come
from zeal's serving engine (a hybrid engine shares the weights with the trainer); each
step prints the mean reward, the KL to the starting model and where the time went.

    python examples/rlhf_grpo.py               # 10 steps of 2 prompts x 4 answers, ~2.5 min on 2 CPU cores
    python examples/rlhf_grpo.py --model PATH  # another HF folder or .gguf (default: the embedded model)
    python examples/rlhf_grpo.py --toy         # 1 step of 1 prompt x 2 short answers (what CI runs)

The command-line equivalent on a built-in arithmetic task: ``zeal rlhf grpo --steps 20``
(``--nproc 2 --zero-stage 3`` for two ranks); metrics land in ``runs/example-grpo/metrics.csv``.
"""
import argparse
import random
import re

from zeal.rlhf import grpo

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--model", help="HF folder or .gguf to train (default: the embedded SmolLM2-135M-Instruct)")
parser.add_argument("--toy", action="store_true", help="1 step, 1 prompt, 2 answers of 8 tokens")
args = parser.parse_args()

rng = random.Random(0)
pairs = [(rng.randint(1, 20), rng.randint(1, 20)) for _ in range(64)]
prompts = [f"What is {a} + {b}? Reply with the number only." for a, b in pairs]


def reward(prompts, completions, **_):
    """1 for the right sum as the first number of the answer, 0.2 more for the number alone."""
    out = []
    for prompt, text in zip(prompts, completions):
        a, b = map(int, re.findall(r"\d+", prompt)[:2])
        found = re.findall(r"-?\d+", text)
        right = bool(found) and int(found[0]) == a + b
        out.append(float(right) + 0.2 * bool(re.fullmatch(r"\s*-?\d+\.?\s*", text)))
    return out


config = {
    "train_micro_batch_size_per_gpu": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 5e-6}},
    "zero_optimization": {"stage": 2},
    "rlhf": {"steps": 1 if args.toy else args.steps, "batch_size": 1 if args.toy else 2,
             "num_generations": 2 if args.toy else 4, "max_new_tokens": 8 if args.toy else 12,
             "temperature": 1.0, "beta": 0.04, "seed": 0},
}
result = grpo(args.model, reward, prompts, config, out="runs/example-grpo")   # None: the embedded model
first, last = result.metrics[0], result.metrics[-1]
print(f"reward: step 1 {first['reward']:.3f} -> step {len(result.metrics)} {last['reward']:.3f}; "
      f"metrics in {result.out}/metrics.csv")
