"""`zeal estimate` for long context: sequence-parallel size, ALST tiling and checkpointing.

Taken by ``zeal estimate --long-context``, and by ``--budget`` from ``--seq-len 16384``
on: one sequence per rank (micro-batch 1), ZeRO-3 over the ranks, every sp × tiling ×
checkpointing plan (formulas: :mod:`zeal.zero.estimate_long`), and with ``--budget``
the cheapest that fits.
"""

from __future__ import annotations

import argparse
import json

from zeal.zero.estimate import ModelShape, fmt_bytes, parse_bytes
from zeal.zero.estimate_long import LongPlan, long_plans, recommend_long


def _plan_json(p: LongPlan) -> dict:
    return {"sequence_parallel_size": p.sp, "tiling": p.tiling, "checkpointing": p.checkpointing,
            "world_size": p.world, "states": p.states, "activations": p.activations, "device": p.device,
            "host_checkpoints": p.host}


def run_long(args: argparse.Namespace, shape: ModelShape, precision: str) -> int:
    """Print the long-context plans (and the recommendation); 1 when nothing fits."""
    plans = long_plans(shape, args.seq_len, args.world_size, precision != "fp32", host=args.device == "cpu",
                       max_sp=args.max_sp)
    budget = parse_bytes(args.budget) if args.budget else None
    host_budget = parse_bytes(args.cpu_budget) if args.cpu_budget else None
    best = recommend_long(plans, budget, host_budget) if budget is not None else None
    if args.json:
        print(json.dumps({"model": shape.name, "params": shape.num_params, "seq_len": args.seq_len,
                          "precision": precision, "device_type": args.device,
                          "plans": [_plan_json(p) for p in plans],
                          "recommended": None if best is None else best.ds_config(),
                          "recommended_plan": None if best is None else _plan_json(best)}, indent=2))
        return 0 if budget is None or best is not None else 1
    print(f"{shape.name}: {shape.num_params / 1e6:.2f}M parameters; one sequence of {args.seq_len} tokens per "
          f"sp group; {precision}; ZeRO stage 3 over max(world {args.world_size}, sp) ranks; {args.device}")
    print(f"{'per rank':<56}{'states':>12}{'activations':>12}{'device':>12}{'host ckpt':>12}")
    for p in plans:
        print(f" {p.description:<55}{fmt_bytes(p.states):>12}{fmt_bytes(p.activations):>12}"
              f"{fmt_bytes(p.device):>12}{fmt_bytes(p.host):>12}")
    print("activations per rank of s/sp tokens: kept for backward (every block's saved tensors, or the layer "
          "inputs with checkpointing, moved to host by cpu_checkpointing) + the larger of the loss's logits "
          "(one tile with tiling) and a block's backward (one MLP tile with tiling); docs/long_context.md")
    if budget is None:
        return 0
    if best is None:
        print(f"nothing fits a device budget of {fmt_bytes(budget)} per rank (sp up to {args.max_sp}, tiling, "
              "checkpointing and offload tried): shorten --seq-len or use a smaller model")
        return 1
    print(f"recommended for {fmt_bytes(budget)} per rank: {best.description} on {best.world} ranks "
          f"(device {fmt_bytes(best.device)}{f', host {fmt_bytes(best.host)}' if best.host else ''}): "
          f"{json.dumps(best.ds_config())}")
    return 0
