"""GRPO with synchronous vs asynchronous rollouts (``rlhf.async_rollouts``) on SmolLM2-135M-Instruct
(the embedded model) and the built-in arithmetic task, beside TRL's ``GRPOTrainer`` in the
same run: samples (completions) per second, mean reward per step and after N steps, the
step's split into generation / training / weight sync / waiting, and with async the share
of the wall time during which the generator thread and the trainer ran at once, beside the
bound that perfect overlap of the synchronous run's generation and training would give.
Same seed, data (prompts in the same order), reward and hyper-parameters for every variant;
``--loss-type`` picks the GRPO-family loss (TRL runs ``grpo``). Variants: ``sync``,
``asyncK`` (k = K), ``asyncKtN`` (the generator thread on N intra-op threads), ``trl``
(TRL in its own virtual environment, ``--trl-python``, through ``_trl_side.py``).

    PYTHONPATH=. python bench/rlhf/bench_async.py --steps 6 --variants sync,async1,trl --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parents[2]


def run_trl(args) -> dict:
    """TRL's ``GRPOTrainer`` (generating with the training model) on the prompts zeal draws,
    in zeal's order; the same figures as :func:`run` where TRL has them."""
    import torch
    from bench_trl import trl_side

    from zeal.models.hf import default_model_path
    from zeal.rlhf.tasks import arithmetic_rows

    prompts = [r["prompt"] for r in arithmetic_rows(64, args.seed)]
    gen = torch.Generator().manual_seed(args.seed * 1000003)  # grpo()'s prompt draws
    order = [i for _ in range(args.steps) for i in torch.randint(len(prompts), (args.prompts,), generator=gen).tolist()]
    spec = {"job": "grpo", "model": str(default_model_path()), "prompts": [prompts[i] for i in order],
            "steps": args.steps, "batch_size": args.prompts, "num_generations": args.n,
            "max_new_tokens": args.new_tokens, "temperature": 1.0, "beta": 0.04, "clip": 0.2, "lr": args.lr,
            "optimizer": "AdamW", "grad_clip": 1.0, "seed": args.seed, "zeal_root": str(ROOT),
            "reward": "graded_arithmetic_reward"}
    t0 = time.perf_counter()
    t = trl_side(args.trl_python, spec, args.timeout)
    steps = t["step_s"]
    steady = sum(steps[1:]) / max(len(steps) - 1, 1)
    per_step = args.prompts * args.n
    return {"variant": "trl", "samples_per_s": per_step * len(steps) / sum(steps),
            "steady_step_s": steady, "steady_samples_per_s": per_step / steady,
            "rewards": [round(r, 4) for r in t["rewards"]], "final_reward": sum(t["rewards"][-2:]) / 2,
            "generate_s": sum(t["generate_s"]), "train_s": sum(steps) - sum(t["generate_s"]),
            "sync_s_per_step": 0.0, "wait_s": 0.0, "wall_s": time.perf_counter() - t0, "staleness": [],
            "elapsed": [round(sum(steps[:i + 1]), 2) for i in range(len(steps))]}


def run(variant: str, args) -> dict:
    from zeal.rlhf import grpo
    from zeal.rlhf.tasks import arithmetic_rows, graded_arithmetic_reward

    if variant == "trl":
        return run_trl(args)
    k_text, _, threads = variant.removeprefix("async").partition("t")
    k = 0 if variant == "sync" else int(k_text)
    rows = arithmetic_rows(64, args.seed)
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}},
           "rlhf": {"steps": args.steps, "batch_size": args.prompts, "num_generations": args.n,
                    "max_new_tokens": args.new_tokens, "beta": 0.04, "seed": args.seed, "loss_type": args.loss_type,
                    "async_rollouts": k, "generation_dtype": args.generation_dtype, "log_every": 1,
                    "async_generator_threads": int(threads) if threads else None}}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="zeal-bench-async-") as out:  # SmolLM2 checkpoints (~1.6 GB): not kept
        res = grpo(None, graded_arithmetic_reward, [r["prompt"] for r in rows], cfg, out=out)
    wall = time.perf_counter() - t0
    m = res.metrics
    samples = args.steps * args.prompts * args.n
    first = m[0]["elapsed_s"]  # model loading etc. precede step 1's line; count from the first step's start
    steady = (m[-1]["elapsed_s"] - first) / max(len(m) - 1, 1)
    out = {"variant": variant, "seed": args.seed, "samples_per_s": samples / m[-1]["elapsed_s"],
           "steady_step_s": steady, "steady_samples_per_s": args.prompts * args.n / steady,
           "rewards": [round(r["reward"], 4) for r in m], "final_reward": sum(r["reward"] for r in m[-2:]) / 2,
           "generate_s": sum(r["time_generate_s"] for r in m), "train_s": sum(r["time_train_s"] for r in m),
           "sync_s_per_step": sum(r["time_sync_s"] for r in m) / len(m),
           "wait_s": sum(r.get("time_wait_s", 0.0) for r in m), "wall_s": wall,
           "staleness": [r["staleness"] for r in m],
           "elapsed": [round(r["elapsed_s"], 2) for r in m],  # from just before step 1 (TRL's: its steps' sum)
           "is_ratio": [[round(r[k], 4) for k in ("is_ratio_min", "is_ratio_mean", "is_ratio_max")]
                        for r in m if "is_ratio_mean" in r]}
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
    ap.add_argument("--seeds", default="0", help="comma-separated seeds; each runs every variant")
    ap.add_argument("--loss-type", default="grpo")
    ap.add_argument("--generation-dtype", default="auto")
    ap.add_argument("--variants", default="sync,async1,trl")
    ap.add_argument("--trl-python", default="/work/peers/trl/bin/python")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds for each TRL run")
    ap.add_argument("--json", help="also write every result to this file")
    args = ap.parse_args()
    results = []
    for seed in [int(x) for x in args.seeds.split(",")]:
        args.seed = seed
        for v in args.variants.split(","):
            r = {**run(v, args), "seed": seed}
            print(json.dumps(r), flush=True)
            results.append(r)
    if args.json:
        Path(args.json).write_text(json.dumps(results))
    report(results)


def report(results: list[dict], last_k: int = 4) -> None:
    """One line per run; per seed the async bound (sync's (gen + train) / max(gen, train))
    and every variant's steady samples/s over TRL's; the mean reward per variant."""
    print(f"{'seed':>4} {'variant':10} {'samples/s':>9} {'steady/s':>9} {'gen s':>7} {'train s':>7} "
          f"{'sync s/step':>11} {'overlap':>8} {'hidden':>7} {'vs TRL':>7} final reward")
    for r in results:
        ov = r.get("overlap", {}).get("overlap_share", 0.0)
        hidden = r.get("overlap", {}).get("hidden_generation_share", 0.0)
        trl = [x for x in results if x["variant"] == "trl" and x["seed"] == r["seed"]]
        vs = f"{r['steady_samples_per_s'] / trl[0]['steady_samples_per_s']:6.2f}x" if trl else "      -"
        print(f"{r['seed']:>4} {r['variant']:10} {r['samples_per_s']:9.2f} {r['steady_samples_per_s']:9.2f} "
              f"{r['generate_s']:7.1f} {r['train_s']:7.1f} {r['sync_s_per_step']:11.3f} {ov:8.1%} {hidden:7.1%} {vs} "
              f"{r['final_reward']:.3f}")
    for r in results:
        if r["variant"] == "sync":
            g, t = r["generate_s"], r["train_s"]
            print(f"seed {r['seed']}: perfect overlap of sync's generation ({g:.1f} s) and training ({t:.1f} s) "
                  f"would give at most {(g + t) / max(g, t):.2f}x over sync (with both on the same cores: less)")
    variants = dict.fromkeys(r["variant"] for r in results)
    for v in variants:
        rs = [r for r in results if r["variant"] == v]
        curve = [sum(x) / len(x) for x in zip(*[r["rewards"] for r in rs])]
        print(f"{v}: mean over {len(rs)} seed(s): final reward {sum(r['final_reward'] for r in rs) / len(rs):.3f}, "
              f"all steps {sum(curve) / max(len(curve), 1):.3f}, steady samples/s "
              f"{sum(r['steady_samples_per_s'] for r in rs) / len(rs):.2f}; curve {' '.join(f'{c:.3f}' for c in curve)}")
    compare(results, last_k)


def _lag(variant: str) -> int:
    """How many updates older than the trainer's the weights that sampled a batch are."""
    return int(variant.removeprefix("async").partition("t")[0]) if variant.startswith("async") else 0


def compare(results: list[dict], last_k: int = 4) -> None:
    """The reward curves three ways, mean over seeds: by step (as logged); by the weights
    version that sampled the batch (step − 1 − k with async k: the policy's learning, free of
    the sampling lag); and by wall time (the mean reward of the last ``last_k`` batches
    finished by each time point, the points at fractions of TRL's (else the slowest's) time)."""
    variants = list(dict.fromkeys(r["variant"] for r in results))
    seeds = sorted({r["seed"] for r in results})
    by = {v: [r for r in results if r["variant"] == v] for v in variants}
    print(f"\nreward, mean over seeds {seeds}; last {last_k} steps per seed and mean:")
    for v in variants:
        per = [sum(r["rewards"][-last_k:]) / len(r["rewards"][-last_k:]) for r in by[v]]
        print(f"  {v:10} " + " ".join(f"seed {r['seed']} {x:.3f}" for r, x in zip(by[v], per))
              + f"  mean {sum(per) / len(per):.3f}")
    for title, shift in (("by step", False), ("by the weights version that sampled the batch", True)):
        print(f"\nreward {title}:")
        n = max(len(r["rewards"]) for r in results)
        print(f"  {'':10} " + " ".join(f"{i + 1 - shift:>6}" for i in range(n)))
        for v in variants:
            curve = [sum(x) / len(x) for x in zip(*[r["rewards"] for r in by[v]])]
            if shift:  # batch t of async k was sampled by version t - 1 - k: line versions up
                curve = curve[_lag(v):]
            print(f"  {v:10} " + " ".join(f"{c:6.3f}" for c in curve))
    ref = "trl" if "trl" in by else max(variants, key=lambda v: sum(r["elapsed"][-1] for r in by[v]))
    t_end = sum(r["elapsed"][-1] for r in by[ref]) / len(by[ref])
    points = [t_end * f for f in (0.125, 0.25, 0.375, 0.5, 0.75, 1.0)]
    print(f"\nreward by wall time (mean of the last {last_k} batches finished by then, mean over seeds; "
          f"'-' none yet; steps done in brackets):")
    print(f"  {'':10} " + " ".join(f"{t:>12.0f}s" for t in points))
    for v in variants:
        cells = []
        for t in points:
            vals, done = [], []
            for r in by[v]:
                k = sum(e <= t for e in r["elapsed"])
                done.append(k)
                if k:
                    vals.append(sum(r["rewards"][max(0, k - last_k):k]) / len(r["rewards"][max(0, k - last_k):k]))
            cells.append(f"{sum(vals) / len(vals):6.3f} ({sum(done) / len(done):4.1f})" if vals else f"{'-':>13}")
        print(f"  {v:10} " + " ".join(cells))


if __name__ == "__main__":
    main()
