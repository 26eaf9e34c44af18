"""Compression of SmolLM2-135M-Instruct: held-out perplexity of every method in one run.

Calibration, fine-tuning and evaluation text are disjoint parts of the pydoc_data topics
(``split_three``: every fifth topic held out for evaluation, every fifth other one for
calibration, the rest fine-tuning, so a budget of K steps is K·batch distinct blocks, under one
epoch). Every method that trains gets the same optimizer steps, blocks, learning rate and loss.
``--only`` runs a subset (comma-separated substrings of the run names) to keep each run short.

    flock /tmp/zeal-heavy.lock python bench/compression/bench_compression.py --steps 32 --loss kd --only 2:4
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch

from zeal.compression.calibration import blocks, perplexity, split_three
from zeal.compression.modules import linear_targets
from zeal.compression.pipeline import CompressJob, compress_model
from zeal.compression.search import Choice, apply_choice, compression_ratio, layer_sensitivity, search
from zeal.inference.llm import load_model_and_tokenizer, resolve_model_path


def _searched(model, calib, evals, budget: float) -> tuple[float, float, dict]:
    """NxMiFormer's search at ``budget`` vs uniform 2:4 + int8 (both PTQ, no training)."""
    options = [Choice(1, 1, 8), Choice(2, 4, 8), Choice(1, 1, 4), Choice(2, 4, 4)]
    targets = linear_targets(model)
    probe = calib[:1]
    table = layer_sensitivity(model, targets, options, lambda m: float(torch.log(torch.tensor(perplexity(m, probe)))))
    sizes = [lin.weight.numel() for lin in targets.values()]
    picks, _ = search(sizes, [options] * len(sizes), table, budget)
    mixed = copy.deepcopy(model)
    with torch.no_grad():
        for (name, _), c in zip(targets.items(), picks):
            w = mixed.get_submodule(name).weight
            w.copy_(apply_choice(w, c))
    counts = {str(c): sum(p == c for p in picks) for c in options}
    uniform = copy.deepcopy(model)
    with torch.no_grad():
        for name in targets:
            w = uniform.get_submodule(name).weight
            w.copy_(apply_choice(w, Choice(2, 4, 8)))
    return perplexity(mixed, evals), perplexity(uniform, evals), {
        "mixed_ratio": round(compression_ratio(sizes, picks), 4), "choices": counts}


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--loss", choices=("ce", "kd"), default="ce", help="fine-tuning loss of every method")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--calib-blocks", type=int, default=8)
    ap.add_argument("--eval-blocks", type=int, default=16)
    ap.add_argument("--admm-metric", choices=("activation", "euclidean"), default="activation")
    ap.add_argument("--admm-objective", choices=("reconstruction", "loss"), default="reconstruction")
    ap.add_argument("--admm-iters", type=int, default=60, help="reconstruction ADMM iterations")
    ap.add_argument("--admm-penalty", choices=("prox", "grad"), default="prox")
    ap.add_argument("--admm-fraction", type=float, default=0.25)
    ap.add_argument("--admm-interval", type=int, default=1)
    ap.add_argument("--rho", type=float, default=0.3)
    ap.add_argument("--rho-max", type=float, default=10.0)
    ap.add_argument("--only", default=None, help="comma-separated substrings of the run names to run")
    ap.add_argument("--search", action="store_true", help="also the per-layer search (layers x 4 evaluations)")
    return ap.parse_args()


def _runs(args: argparse.Namespace) -> dict[str, CompressJob]:
    k = args.steps
    common = {"steps": k, "lr": args.lr, "batch": args.batch, "loss": args.loss}
    admm = {"admm_metric": args.admm_metric, "admm_penalty": args.admm_penalty, "admm_fraction": args.admm_fraction,
            "admm_interval": args.admm_interval, "rho": args.rho, "rho_max": args.rho_max,
            "admm_objective": args.admm_objective, "admm_iters": args.admm_iters}
    ka = int(k * args.admm_fraction) if args.admm_objective == "loss" else 0
    admm_name = f"2:4 admm {ka} + {k - ka} steps" if ka else f"2:4 admm recon + {k} steps"
    runs = {
        "2:4 magnitude one-shot": CompressJob(2, 4, "magnitude"),
        "2:4 wanda one-shot": CompressJob(2, 4, "wanda"),
        "2:4 admm recon one-shot": CompressJob(2, 4, "admm", admm_iters=args.admm_iters),
        f"2:4 magnitude + {k} steps": CompressJob(2, 4, "magnitude", **common),
        f"2:4 wanda + {k} steps": CompressJob(2, 4, "wanda", **common),
        admm_name: CompressJob(2, 4, "admm", **common, **admm),
        "int8 PTQ": CompressJob(None, 4, bits=8),
        "int4 PTQ": CompressJob(None, 4, bits=4),
        f"int4 QAT {k} steps": CompressJob(None, 4, bits=4, **common),
        "int4 g32 PTQ": CompressJob(None, 4, bits=4, group_size=32),
    }
    if k == 0:  # one-shot only
        runs = {name: job for name, job in runs.items() if "steps" not in name}
    if args.only:
        keys = [x.strip() for x in args.only.split(",") if x.strip()]
        runs = {name: job for name, job in runs.items() if any(x in name for x in keys)}
    return runs


def main() -> None:
    args = _args()
    base, tok, _ = load_model_and_tokenizer(resolve_model_path(None), torch.float32)
    ctext, ttext, etext = split_three(None)
    calib = blocks(tok.encode(ctext, add_special_tokens=False), args.seq_len, args.calib_blocks)
    train = blocks(tok.encode(ttext, add_special_tokens=False), args.seq_len)
    evals = blocks(tok.encode(etext, add_special_tokens=False), args.seq_len, args.eval_blocks)
    epochs = args.steps * args.batch / train.shape[0]
    print(f"calibration {calib.shape[0]}, fine-tuning {train.shape[0]}, evaluation {evals.shape[0]} blocks of "
          f"{args.seq_len} tokens; {args.steps} steps x {args.batch} blocks = {epochs:.2f} epochs", flush=True)
    t0 = time.perf_counter()
    dense = perplexity(base, evals)
    results = {"dense": round(dense, 3)}
    print(f"{'dense':<32} ppl {dense:9.3f}   ({time.perf_counter() - t0:.0f} s)", flush=True)
    for name, job in _runs(args).items():
        t0 = time.perf_counter()
        model = copy.deepcopy(base)
        report = compress_model(model, calib, evals, job, log=lambda _: None, before=dense, train=train)
        results[name] = round(report.ppl_after, 3)
        extra = ""
        if report.admm_residuals:
            r0, r1 = report.admm_residuals[0], report.admm_residuals[-1]
            extra = (f"  primal/|W| {r0.primal_rel:.3f} -> {r1.primal_rel:.4f}, dual {r0.dual:.3g} -> {r1.dual:.3g}, "
                     f"rho -> {r1.rho:.3g}")
            results[name + " primal_rel"] = [round(r.primal_rel, 5) for r in report.admm_residuals]
        print(f"{name:<32} ppl {report.ppl_after:9.3f}   ({time.perf_counter() - t0:.0f} s){extra}", flush=True)
        del model
    if args.search:
        t0 = time.perf_counter()
        mixed, uniform, info = _searched(base, calib, evals, 0.875)
        results["searched mixed @87.5%"], results["uniform 2:4+int8 @87.5%"] = round(mixed, 3), round(uniform, 3)
        print(f"{'searched mixed @87.5%':<32} ppl {mixed:9.3f}   {info}  ({time.perf_counter() - t0:.0f} s)")
        print(f"{'uniform 2:4+int8 @87.5%':<32} ppl {uniform:9.3f}")
    print(json.dumps({"args": vars(args), "ppl": results}))


if __name__ == "__main__":
    main()
