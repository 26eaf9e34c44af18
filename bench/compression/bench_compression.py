"""Compression of SmolLM2-135M-Instruct: held-out perplexity of every method in one run.

Calibration/fine-tuning and evaluation text are the pydoc_data topics (every fifth held
out). Every method that trains gets the same optimizer steps on the same blocks.

    flock /tmp/zeal-heavy.lock python bench/compression/bench_compression.py --steps 16
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch

from zeal.compression.calibration import blocks, perplexity, split_text
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--calib-blocks", type=int, default=8)
    ap.add_argument("--eval-blocks", type=int, default=8)
    ap.add_argument("--search", action="store_true", help="also the per-layer search (layers x 4 evaluations)")
    args = ap.parse_args()
    base, tok, _ = load_model_and_tokenizer(resolve_model_path(None), torch.float32)
    ctext, etext = split_text(None)
    calib = blocks(tok.encode(ctext, add_special_tokens=False), args.seq_len, args.calib_blocks)
    evals = blocks(tok.encode(etext, add_special_tokens=False), args.seq_len, args.eval_blocks)
    k = args.steps
    runs = {
        "2:4 magnitude one-shot": CompressJob(2, 4, "magnitude"),
        "2:4 wanda one-shot": CompressJob(2, 4, "wanda"),
        f"2:4 magnitude + {k} steps": CompressJob(2, 4, "magnitude", steps=k, lr=args.lr),
        f"2:4 wanda + {k} steps": CompressJob(2, 4, "wanda", steps=k, lr=args.lr),
        f"2:4 admm {k // 2} + {k - k // 2} steps": CompressJob(2, 4, "admm", steps=k, lr=args.lr),
        "int8 PTQ": CompressJob(None, 4, bits=8),
        "int4 PTQ": CompressJob(None, 4, bits=4),
        f"int4 QAT {k} steps": CompressJob(None, 4, bits=4, steps=k, lr=args.lr),
        "int4 g32 PTQ": CompressJob(None, 4, bits=4, group_size=32),
    }
    if k == 0:  # one-shot only
        runs = {name: job for name, job in runs.items() if "steps" not in name}
    t0 = time.perf_counter()
    dense = perplexity(base, evals)
    results = {"dense": round(dense, 3)}
    print(f"{'dense':<32} ppl {dense:9.3f}   ({time.perf_counter() - t0:.0f} s)", flush=True)
    for name, job in runs.items():
        t0 = time.perf_counter()
        model = copy.deepcopy(base)
        ppl = compress_model(model, calib, evals, job, log=lambda _: None, before=dense).ppl_after
        results[name] = round(ppl, 3)
        print(f"{name:<32} ppl {ppl:9.3f}   ({time.perf_counter() - t0:.0f} s)", flush=True)
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
