"""Activation checkpointing: peak RSS per rank and step time, with and without.

zeal stage 3 and PyTorch FSDP2 (the peer, ``fully_shard`` per block, the same GPT
with the same per-block non-reentrant ``torch.utils.checkpoint``) each train the
124M GPT on 2 gloo ranks, fp32, micro-batch 4 × 256, with checkpointing off and
on. The *activation part* of a peak is the peak minus the same system's peak
for a run with a negligible batch (1 × 8 tokens: model states and the optimizer
step, but next to no activations). Jobs are the ones of ``bench_zero.py``
(one ``torchrun`` job per configuration), run in alternating order with
``--repeats``.

    python bench/train/bench_checkpointing.py --repeats 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_zero import run_job  # noqa: E402


def _spec(kind: str, ckpt: bool, micro: int, seq: int, args) -> dict:
    return dict(kind=kind, stage=3 if kind == "zeal" else None, size=args.size, dtype=args.dtype, micro=micro,
                seq=seq, warmup=args.warmup, steps=args.steps, ckpt=ckpt)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="124m", help="10m or 124m (default 124m)")
    ap.add_argument("--dtype", default="fp32", help="fp32 or bf16")
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--peers", default="zeal,fsdp2", help="comma list of zeal,fsdp2")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    args.ds_python = sys.executable
    kinds = args.peers.split(",")
    results: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.repeats):
        jobs = [(k, c) for k in kinds for c in ("base", "off", "on")]
        for kind, case in (jobs if r % 2 == 0 else jobs[::-1]):
            micro, seq = (1, 8) if case == "base" else (args.micro, args.seq)
            res = run_job(_spec(kind, case == "on", micro, seq, args), args)
            if res is not None:
                results.setdefault((kind, case), []).append(res)

    def med(kind, case, key):
        rows = results.get((kind, case), [])
        vals = [max(x["rss_mib"]) if key == "rss" else x["step_s"] for x in rows]
        return statistics.median(vals) if vals else float("nan")

    print(f"\n{args.size} GPT, {args.dtype}, {args.nproc} ranks, micro {args.micro} x {args.seq}, "
          f"median of {args.repeats} round(s)")
    print(f"{'system':8s} {'ckpt':4s} {'s/step':>7s} {'peak MiB':>9s} {'act. MiB':>9s}")
    summary = {}
    for kind in kinds:
        base = med(kind, "base", "rss")
        for case in ("off", "on"):
            s, rss = med(kind, case, "step"), med(kind, case, "rss")
            summary[(kind, case)] = (s, rss, rss - base)
            print(f"{kind:8s} {case:4s} {s:7.3f} {rss:9.0f} {rss - base:9.0f}")
        print(f"{kind:8s} base peak (1 x 8 tokens) {base:.0f} MiB")
    for kind in kinds:
        (s0, _, a0), (s1, _, a1) = summary[(kind, "off")], summary[(kind, "on")]
        print(f"{kind}: activation part {a0:.0f} -> {a1:.0f} MiB ({a0 / a1:.2f}x smaller); "
              f"step time x{s1 / s0:.2f} with checkpointing")
    if "fsdp2" in kinds and "zeal" in kinds:
        for case in ("off", "on"):
            z, f = summary[("zeal", case)], summary[("fsdp2", case)]
            print(f"ckpt {case}: zeal / FSDP2 step time {z[0] / f[0]:.2f}x, peak RSS {z[1] / f[1]:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({f"{k}:{c}": v for (k, c), v in results.items()}, indent=1))


if __name__ == "__main__":
    main()
