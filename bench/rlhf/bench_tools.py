"""The calculator-tool task (``zeal.rlhf.tasks.calculator_task``: "What is 4*2 ?", a
word-level vocabulary in which each tool call is one token) trained with multi-turn GRPO
from the config (``rlhf.tools: [calculator]``, ``rlhf.verifiers: [math]``, a tool-use
shaping reward) on a 2-layer Llama: the reward curve, the tool calls per episode, and the
answer accuracy (the math verifier on the final answer, no shaping) and tool-use rate of
sampled episodes before and after training, per seed.

    PYTHONPATH=. python bench/rlhf/bench_tools.py --steps 40 --seeds 1,2,3
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch


def tiny_llama(vocab: int, seed: int):
    from zeal.models.llama import Llama, LlamaConfig

    torch.manual_seed(seed)
    return Llama(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                             eos_token_id=1))


def evaluate(hybrid, tok, rows, n: int, seed: int, max_turns: int) -> dict:
    """Answer accuracy and tool-use rate of ``n`` sampled episodes (temperature 1) per row."""
    from zeal.inference.sampling_params import SamplingParams
    from zeal.rlhf import tools, verifiers
    from zeal.rlhf.multiturn import ToolEnv, run_episodes

    fns, specs = tools.builtin_tools()
    envs = [ToolEnv(tok, row, fns, specs, [verifiers.math_answer_reward]) for row in rows for _ in range(n)]
    _, rewards = run_episodes(hybrid, envs, SamplingParams(n=1, max_tokens=1, temperature=1.0, seed=seed),
                              max_turns, sync=True)
    return {"accuracy": sum(rewards) / len(rewards), "tool_use": sum(e.calls > 0 for e in envs) / len(envs)}


def run(seed: int, args) -> dict:
    from zeal.rlhf import grpo
    from zeal.rlhf.common import build_engine
    from zeal.rlhf.hybrid import HybridEngine
    from zeal.rlhf.tasks import calculator_task

    tok, rows, vocab = calculator_task()
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": args.lr}}}
    before_engine = build_engine(tiny_llama(vocab, seed), cfg, 16, job="eval")
    before = evaluate(HybridEngine(before_engine, tok, eos_token_ids=[1], kv_cache_bytes=1 << 22), tok, rows,
                      args.eval_n, 10_000 + 1000 * seed, args.max_turns)
    rc = {"steps": args.steps, "batch_size": 4, "num_generations": 4, "max_new_tokens": 1,
          "max_turns": args.max_turns, "beta": 0.0, "generation_dtype": "fp32", "loss_type": "dapo", "seed": seed,
          "tools": ["calculator"], "verifiers": ["math"], "tool_reward": args.tool_reward, "log_every": 10**6}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="zeal-bench-tools-") as out:  # the run's checkpoints: not kept
        res = grpo(tiny_llama(vocab, seed), None, rows, {**cfg, "rlhf": rc}, tokenizer=tok, eos_token_ids=[1],
                   out=out)
    wall = time.perf_counter() - t0
    after = evaluate(res.extra["hybrid"], tok, rows, args.eval_n, 10_000 + 1000 * seed, args.max_turns)
    m = res.metrics
    return {"seed": seed, "before": before, "after": after, "wall_s": wall,
            "reward": [round(r["reward"], 4) for r in m], "tool_calls": [round(r["tool_calls"], 3) for r in m]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--tool-reward", type=float, default=0.5)
    ap.add_argument("--max-turns", type=int, default=2)
    ap.add_argument("--eval-n", type=int, default=16, help="sampled episodes per question in the evaluation")
    args = ap.parse_args()
    results = [run(int(s), args) for s in args.seeds.split(",")]
    for r in results:
        print(json.dumps(r))
    print(f"{'seed':>4} {'acc before':>10} {'acc after':>9} {'tool use before':>15} {'after':>6} "
          f"{'reward first 5':>14} {'last 5':>7} {'wall s':>7}")
    for r in results:
        rw = r["reward"]
        print(f"{r['seed']:>4} {r['before']['accuracy']:>10.3f} {r['after']['accuracy']:>9.3f} "
              f"{r['before']['tool_use']:>15.3f} {r['after']['tool_use']:>6.3f} {sum(rw[:5]) / 5:>14.3f} "
              f"{sum(rw[-5:]) / 5:>7.3f} {r['wall_s']:>7.1f}")


if __name__ == "__main__":
    main()
