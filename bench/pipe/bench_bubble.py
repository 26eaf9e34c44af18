"""Pipeline bubble: measured idle fraction of 1F1B, GPipe and interleaved 1F1B against
(P-1)/(M+P-1) (interleaved with V virtual stages: (P-1)/(V·M+P-1)).

Runs zeal's GPT cut into P stages on P gloo ranks (one thread each), ZeRO stage 1, fp32,
and for M micro-batches per step measures, per stage, the time spent waiting for a
peer (receives) over the train_batch wall time, after one warm-up step; prints the
mean over stages beside the formula, and the most micro-batches whose activations a
stage held (the schedule's bound: P - stage for 1F1B, M for GPipe).

    flock /tmp/zeal-heavy.lock python bench/pipe/bench_bubble.py --stages 2 --micro 4 8 16
    flock /tmp/zeal-heavy.lock python bench/pipe/bench_bubble.py --schedules 1f1b interleaved --virtual 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _shared import spawn_ranks  # noqa: E402


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import zeal
    from zeal.models.gpt import GPT, GPTConfig

    rows = []
    for schedule in args.schedules:
        for m in args.micro:
            torch.manual_seed(0)
            cfg = GPTConfig(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.dim, n_layer=args.layers, n_head=4)
            engine = zeal.initialize(GPT(cfg), {
                "train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": m,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 1},
                "pipeline_parallel": {"size": world, "schedule": schedule,
                                      "virtual_stages": args.virtual if schedule == "interleaved" else 1}})
            x = torch.randint(0, args.vocab, (m, args.batch, args.seq))
            engine.train_batch(iter([(x[i], x[i]) for i in range(m)]))  # warm-up
            t0 = time.perf_counter()
            engine.train_batch(iter([(x[i], x[i]) for i in range(m)]))
            wall = time.perf_counter() - t0
            rows.append({"schedule": schedule, "M": m, "stage": rank, "wall": wall, "wait": engine.bubble_time,
                         "peak": engine.peak_in_flight})
            engine.close()
    q.put(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--micro", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--schedules", nargs="+", default=["1f1b", "gpipe"])
    ap.add_argument("--virtual", type=int, default=2, help="virtual stages per rank (interleaved)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    args = ap.parse_args()
    procs, q = spawn_ranks(_rank, args.stages, lambda r, port, q: (r, args.stages, port, args, q))
    rows = [r for _ in procs for r in q.get(timeout=600)]
    for p in procs:
        p.join(timeout=30)
    print(f"P={args.stages}  GPT {args.layers}x{args.dim}, vocab {args.vocab}, micro-batch {args.batch}x{args.seq}, gloo, 1 thread/rank")
    print(f"{'schedule':8} {'M':>3} {'measured':>9} {'formula':>8} {'ratio':>6}  peak in flight per stage")
    for schedule in args.schedules:
        for m in args.micro:
            mine = sorted((r for r in rows if r["schedule"] == schedule and r["M"] == m), key=lambda r: r["stage"])
            measured = sum(r["wait"] / r["wall"] for r in mine) / len(mine)
            v = args.virtual if schedule == "interleaved" else 1
            formula = (args.stages - 1) / (v * m + args.stages - 1)
            print(f"{schedule:8} {m:>3} {measured:>9.3f} {formula:>8.3f} {measured / formula:>6.2f}  "
                  f"{[r['peak'] for r in mine]}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
