"""GRPO with synchronous vs asynchronous rollouts (``rlhf.async_rollouts``) on SmolLM2-135M-Instruct
(the embedded model) and the built-in arithmetic task: samples (completions) per second,
mean reward per step and after N steps, the step's split into generation / training /
weight sync / waiting, and with async the share of the wall time during which the
generator thread and the trainer ran at once. Same seed, data and hyper-parameters for
every variant; ``--loss-type`` picks the GRPO-family loss.

    PYTHONPATH=. python bench/rlhf/bench_async.py --steps 6 --variants sync,async1
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time


def run(variant: str, args) -> dict:
    from zeal.rlhf import grpo
    from zeal.rlhf.tasks import arithmetic_rows, graded_arithmetic_reward

    k = 0 if variant == "sync" else int(variant.removeprefix("async"))
    rows = arithmetic_rows(64, args.seed)
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}},
           "rlhf": {"steps": args.steps, "batch_size": args.prompts, "num_generations": args.n,
                    "max_new_tokens": args.new_tokens, "beta": 0.04, "seed": args.seed, "loss_type": args.loss_type,
                    "async_rollouts": k, "generation_dtype": args.generation_dtype, "log_every": 1}}
    t0 = time.perf_counter()
    res = grpo(None, graded_arithmetic_reward, [r["prompt"] for r in rows], cfg, out=tempfile.mkdtemp())
    wall = time.perf_counter() - t0
    m = res.metrics
    samples = args.steps * args.prompts * args.n
    first = m[0]["elapsed_s"]  # model loading etc. precede step 1's line; count from the first step's start
    steady = (m[-1]["elapsed_s"] - first) / max(len(m) - 1, 1)
    out = {"variant": variant, "samples_per_s": samples / m[-1]["elapsed_s"],
           "steady_step_s": steady, "steady_samples_per_s": args.prompts * args.n / steady,
           "rewards": [round(r["reward"], 4) for r in m], "final_reward": sum(r["reward"] for r in m[-2:]) / 2,
           "generate_s": sum(r["time_generate_s"] for r in m), "train_s": sum(r["time_train_s"] for r in m),
           "sync_s_per_step": sum(r["time_sync_s"] for r in m) / len(m),
           "wait_s": sum(r.get("time_wait_s", 0.0) for r in m), "wall_s": wall,
           "staleness": [r["staleness"] for r in m]}
    if "async" in res.extra:
        out["overlap"] = {k: round(v, 3) for k, v in res.extra["async"].items()}
    res.engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4, help="answers per prompt")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--loss-type", default="grpo")
    ap.add_argument("--generation-dtype", default="auto")
    ap.add_argument("--variants", default="sync,async1")
    args = ap.parse_args()
    results = [run(v, args) for v in args.variants.split(",")]
    for r in results:
        print(json.dumps(r))
    print(f"{'variant':8} {'samples/s':>9} {'steady/s':>9} {'gen s':>7} {'train s':>7} {'sync s/step':>11} "
          f"{'overlap':>8} final reward")
    for r in results:
        ov = r.get("overlap", {}).get("overlap_share", 0.0)
        print(f"{r['variant']:8} {r['samples_per_s']:9.2f} {r['steady_samples_per_s']:9.2f} {r['generate_s']:7.1f} "
              f"{r['train_s']:7.1f} {r['sync_s_per_step']:11.3f} {ov:8.1%} {r['final_reward']:.3f}")


if __name__ == "__main__":
    main()
