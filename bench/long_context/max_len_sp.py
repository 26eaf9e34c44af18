"""The max-length rows at SP 1, 2 and 4 under one small per-rank budget (issue 38).

Same trial as :mod:`max_len` (one fresh ``torchrun`` job per length; zeal's ≈100M Llama,
8 layers, bf16, ZeRO 3 at every row so model states and the optimizer's are what a
rank holds before the measured step), with ``--measure step``: a warm-up step of 128
tokens makes the optimizer states, then the budget bounds the peak RSS of one
forward + backward at the trial length above the RSS before it (the step's activations,
its gathered parameters and gradients). That keeps lengths short enough for a 2-core host.

``--budget auto`` fixes the budget from two SP 1 tiled trials (1024 and 2048 tokens,
unbounded): the RSS line through them, evaluated at ``--target`` tokens, rounded up to
8 MiB; it is then the same for every row. Rows: SP 1 untiled (no checkpointing, whole
logits), SP 1 tiled (TiledMLP + tiled loss + checkpointing with ``cpu_checkpointing``),
SP 2 and SP 4 tiled (Ulysses; 2 / 4 ranks, one thread each). SP S starts at
0.8·S × the SP 1 tiled length and grows by 1.25× until a length fails, then bisects.
Each row stops after ``--row-seconds``; a row that ran out of time reports its bracket.

    flock -w 1500 /tmp/zeal-cpu.lock python bench/long_context/max_len_sp.py --budget auto \\
        --json bench/long_context/results/max_len_sp.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import max_len as ml  # noqa: E402 - the trial runner beside this file

MIB = 1 << 20


def _trial(args: argparse.Namespace, mode: str, sp: int, seq: int) -> dict:
    ns = argparse.Namespace(**vars(args))
    ns.sp, ns.threads = sp, (2 if sp == 1 else 1)
    t0 = time.perf_counter()
    r = ml._run_trial(ns, mode, seq)
    r["wall_s"] = time.perf_counter() - t0
    peak = f"{r['peak'] / MIB:7.1f} MiB" if "peak" in r else ""
    print(f"  sp {sp} {mode:<8} {seq:>6}: {'ok ' if r['ok'] else 'NO '} {peak} "
          f"step {r.get('step_s') or 0:.1f} s (trial {r['wall_s']:.0f} s) {r.get('why', '')}", flush=True)
    return r


def _up(x: float, res: int) -> int:
    return int(math.ceil(x / res) * res)


def longest(args: argparse.Namespace, mode: str, sp: int, start: int, res: int, grow: float) -> dict:
    """Grow from ``start`` by ``grow`` until a length fails, then bisect to ``res``."""
    t_end = time.perf_counter() + args.row_seconds
    good, bad, seq, best, trials = 0, None, start, None, 0
    while time.perf_counter() < t_end:
        r = _trial(args, mode, sp, seq)
        trials += 1
        if r["ok"]:
            good, best = seq, r
        else:
            bad = seq
        if bad is None:
            seq = max(_up(seq * grow, res), seq + res)
        elif good == 0:
            if seq <= res:
                break
            seq = max(res, seq // 2 // res * res)
        else:
            if bad - good <= res:
                break
            seq = (good + bad) // 2 // res * res
            if seq <= good:
                break
    return {"mode": mode, "sp": sp, "max_len": good, "first_fail": bad, "resolution": res, "trials": trials,
            "complete": bad is not None and good > 0 and bad - good <= res,
            **({} if best is None else {"peak": best["peak"], "step_s": best["step_s"]})}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", default="auto", help="forward+backward RSS above the pre-step RSS, per rank; or auto")
    p.add_argument("--target", type=int, default=1792, help="auto: the SP 1 tiled length the budget is set at")
    p.add_argument("--sps", default="1,2,4", help="tiled SP sizes (1 first)")
    p.add_argument("--untiled", action=argparse.BooleanOptionalAction, default=True, help="the SP 1 untiled row")
    p.add_argument("--row-seconds", type=float, default=150.0, help="time per row (default 150)")
    p.add_argument("--trial-timeout", type=float, default=120.0)
    p.add_argument("--mmap-threshold", type=int, default=1 << 20, help="glibc's mmap/trim thresholds in the trials "
                   "(bytes, default 1 MiB); lower: fewer small tensors from the C heap, whose slack varies by rank")
    p.add_argument("--json")
    args = p.parse_args()
    defaults = dict(layers=8, hidden=768, intermediate=2048, heads=12, kv_heads=4, vocab=32000, zero=3,
                    measure="step", warmup=128)
    for k, v in defaults.items():
        setattr(args, k, v)
    t0 = time.perf_counter()
    calib = {}
    if args.budget == "auto":
        args.budget_bytes = 1 << 40
        calib = {n: _trial(args, "tiled", 1, n) for n in (1024, 2048)}
        if not all(c["ok"] for c in calib.values()):
            print("calibration failed", calib)
            return 1
        k = (calib[2048]["peak"] - calib[1024]["peak"]) / 1024
        args.budget_bytes = _up(calib[1024]["peak"] + k * (args.target - 1024), 8 * MIB)
    else:
        args.budget_bytes = ml._bytes(args.budget)
    print(f"budget {args.budget_bytes / MIB:.0f} MiB per rank (forward + backward above the pre-step RSS)",
          flush=True)
    rows = []
    if args.untiled:
        rows.append(longest(args, "untiled", 1, 128, 32, 2.0))
    base = None
    for sp in map(int, args.sps.split(",")):
        if sp == 1:
            r = longest(args, "tiled", 1, 1024, 128, 1.5)
            base = r["max_len"]
        else:
            res = 128 * sp
            r = longest(args, "tiled", sp, max(res, int(0.8 * sp * (base or 1024)) // res * res), res, 1.25)
        rows.append(r)
    for r in rows:
        ratio = f"{r['max_len'] / base:.2f}x SP 1 tiled" if base else ""
        print(f"{r['mode']:<8} sp {r['sp']}: longest {r['max_len']} (first fail {r['first_fail']}, resolution "
              f"{r['resolution']}{'' if r['complete'] else ', row out of time'}) {ratio}")
    print(f"total {time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"budget": args.budget_bytes, "calibration": {
            str(n): {k: c.get(k) for k in ("peak", "step_s")} for n, c in calib.items()}, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
