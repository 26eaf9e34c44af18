"""Compiled vs eager training step time: zeal's ``compile`` section (regional
``torch.compile`` of every block, inductor) against the same run without it, at ZeRO
stages 0 and 3, in one ``torchrun`` job of ``--nproc`` gloo ranks on CPU.

Each variant builds its engine afresh from the same seed and trains on the same data;
the first ``--warmup`` steps (which include the compilation) are reported apart from
the median of the ``--steps`` timed ones. The losses of the first step are compared
(compiled vs eager, fp32: rounding only). Variants run in the order eager, compiled,
compiled, eager over the two stages so that drift hits both alike.

Example::

    python bench/train/bench_compile.py --size 124m --warmup 2 --steps 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
from _shared import load_gpt  # noqa: E402

SIZES = {
    "10m": dict(vocab_size=8192, n_positions=256, n_embd=256, n_layer=10, n_head=8),
    "124m": dict(vocab_size=50257, n_positions=256, n_embd=768, n_layer=12, n_head=12),
}
ORDER = [(0, False), (0, True), (3, True), (3, False)]


def worker(spec: dict) -> None:
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    import torch
    import torch.distributed as dist

    import zeal

    zeal.apply_process_settings()
    GPT, GPTConfig = load_gpt()
    cfg = GPTConfig(**SIZES[spec["size"]], dropout=0.0)
    cfg.n_positions = spec["seq"]
    out = {}
    for stage, compiled in ORDER:
        torch.manual_seed(0)
        zcfg = {"train_micro_batch_size_per_gpu": spec["micro"], "gradient_accumulation_steps": 1,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                "zero_optimization": {"stage": stage}, "compile": {"enabled": compiled}}
        engine = zeal.initialize((lambda: GPT(cfg)) if stage == 3 else GPT(cfg), zcfg)
        rank = dist.get_rank()
        gen = torch.Generator().manual_seed(1000 + rank)
        times, losses = [], []
        for _ in range(spec["warmup"] + spec["steps"]):
            x = torch.randint(0, cfg.vocab_size, (spec["micro"], spec["seq"]), generator=gen)
            dist.barrier()
            t0 = time.perf_counter()
            loss = engine(x, labels=x)
            engine.backward(loss)
            engine.step()
            times.append(time.perf_counter() - t0)
            losses.append(float(loss))
        engine.close()
        w = spec["warmup"]
        out[f"stage{stage}_{'compiled' if compiled else 'eager'}"] = {
            "warmup_s": round(sum(times[:w]), 2), "step_s": round(statistics.median(times[w:]), 4),
            "first_loss": losses[0]}
        dist.barrier()
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--size", default="124m", choices=list(SIZES))
    ap.add_argument("--micro", type=int, default=1)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=2, help="steps before timing (compilation included)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps (median reported)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=1200)
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    spec = {"size": args.size, "micro": args.micro, "seq": args.seq, "warmup": args.warmup, "steps": args.steps}
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    if r.returncode or line is None:
        print(r.stderr[-3000:], file=sys.stderr)
        return 1
    res = json.loads(line[len("RESULT "):])
    print(f"GPT {args.size}, {args.nproc} gloo ranks x OMP_NUM_THREADS=1, micro {args.micro} x seq {args.seq}, fp32, "
          f"median of {args.steps} steps after {args.warmup} warm-up")
    print(f"{'variant':<18}{'warm-up s':>10}{'step s':>10}{'first loss':>12}")
    for k, v in res.items():
        print(f"{k:<18}{v['warmup_s']:>10}{v['step_s']:>10}{v['first_loss']:>12.5f}")
    for s in (0, 3):
        e, c = res[f"stage{s}_eager"], res[f"stage{s}_compiled"]
        print(f"stage {s}: compiled/eager step time {c['step_s'] / e['step_s']:.3f}; "
              f"first-loss |diff| {abs(c['first_loss'] - e['first_loss']):.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps({"spec": spec, "nproc": args.nproc, "results": res}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
