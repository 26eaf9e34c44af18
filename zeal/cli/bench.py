"""`zeal bench`: step time and peak memory per ZeRO stage, beside `zeal estimate`.

Runs a short `zeal train` job for each stage asked (same model, data and batch),
then prints, per stage: median-free mean step time, tokens/s, peak RSS per rank,
the growth of peak RSS over the process's size before the model was built (torch,
gloo and the data), and the planner's per-rank peak estimate (model states, the
step's working memory, the process baseline and allocator slack: `zeal estimate
--device cpu`), with the relative error of the estimate against the peak RSS.
The model is zeal's GPT (`zeal train --model gpt`); shape flags are those of `zeal train`
(``--model.n_embd 512`` ...).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from zeal.zero.estimate import fmt_bytes, gpt_shape, plan


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``zeal bench``."""
    p = subparsers.add_parser(
        "bench", help="measure step time and peak memory per ZeRO stage beside the estimate",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=[0, 1, 2, 3],
                   help="ZeRO stages to run (default 0 1 2 3)")
    p.add_argument("--nproc", type=int, default=2, help="processes (default 2)")
    p.add_argument("--steps", type=int, default=20, help="steps per stage (default 20)")
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="fp32", help="default fp32")
    p.add_argument("--out", default=None, help="folder for the runs (default: a temporary folder)")
    p.set_defaults(_allow_extra=True)
    return p


def run(args: argparse.Namespace, extra: list[str] | None = None) -> int:
    """Run the jobs and print the table."""
    extra = list(extra or [])
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="zeal-bench-"))
    rows = []
    for stage in args.stages:
        run_dir = out / f"stage{stage}"
        cmd = [sys.executable, "-m", "zeal.cli.main", "train", "--model", "gpt", "--zero-stage", str(stage),
               "--nproc", str(args.nproc), "--steps", str(args.steps), "--precision", args.precision, "--run-dir",
               str(run_dir), "--job.sample_tokens", "0", "--job.eval_interval", "0", "--job.eval_batches", "1",
               "--job.checkpoint", "false", "--job.log_interval", str(max(1, args.steps)), *extra]
        print(f"bench: stage {stage} ...", flush=True)
        rc = subprocess.call(cmd, stdout=subprocess.DEVNULL)
        if rc != 0:
            print(f"bench: stage {stage} failed (exit {rc}); rerun: {' '.join(cmd)}", file=sys.stderr)
            return rc
        rows.append(json.loads((run_dir / "summary.json").read_text()))
    spec = json.loads((out / f"stage{args.stages[0]}" / "config.json").read_text())
    m, d = spec["model"], spec["data"]
    micro = spec["engine"].get("train_micro_batch_size_per_gpu") or 1
    ckpt = spec["engine"].get("activation_checkpointing") is not None  # zeal train --checkpoint-activations
    shape = gpt_shape(m["n_layer"], m["n_embd"], m["n_head"], d["vocab_size"], d["seq_len"])
    print(f"{shape.name}, {shape.num_params / 1e6:.2f}M params, {args.nproc} ranks, micro-batch {micro} x "
          f"{d['seq_len']}, {args.steps} steps, {'bf16' if rows[0]['bf16'] else 'fp32'}")
    print(f"{'stage':<6}{'s/step':>9}{'tok/s':>10}{'peak RSS':>12}{'RSS growth':>12}{'estimate':>12}{'error':>8}")
    for r in rows:
        est = plan(shape, r["world_size"], r["zero_stage"], micro_batch=micro, seq_len=d["seq_len"],
                   mixed_precision=r["bf16"], checkpointing=ckpt, host=True).device
        peak = max(r["peak_rss_bytes_per_rank"])
        growth = max(p - b for p, b in zip(r["peak_rss_bytes_per_rank"], r["rss_before_model_bytes_per_rank"]))
        steps = max(1, r["steps"] - r["start_step"])
        print(f"{r['zero_stage']:<6}{r['train_time_s'] / steps:>9.3f}{r['tokens_per_s']:>10.0f}"
              f"{fmt_bytes(peak):>12}{fmt_bytes(growth):>12}{fmt_bytes(est):>12}"
              f"{(est - peak) / max(peak, 1):>+8.0%}")
    print(f"runs in {out}; RSS growth = peak RSS - RSS before the model was built (max over ranks); "
          "error = (estimate - peak RSS) / peak RSS")
    return 0
