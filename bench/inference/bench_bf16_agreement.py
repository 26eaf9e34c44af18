"""bf16 greedy agreement with fp32: the fused CPU kernels beside the pure-torch bf16 path.

    flock /tmp/zeal-heavy.lock python bench/inference/bench_bf16_agreement.py [--prompts 140] [--tokens 32]

For each chat prompt of ``chat_prompts.txt`` (140), SmolLM2-135M-Instruct (the embedded
model) answers greedily in fp32 (the reference), then in bf16 through the fused kernels
and through torch ops (``ZEAL_CPU_KERNELS=0``'s path). Printed per path: the median first
divergence from fp32, prompts diverging within the first 8 tokens, prompts identical over
the horizon; and the rule of tests/inference/test_bf16_agreement.py (fused at least as close).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from zeal.inference.agreement import at_least_as_close, bf16_agreement
from zeal.inference.llm import load_model_and_tokenizer

HERE = Path(__file__).parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=140)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    prompts = (HERE / "chat_prompts.txt").read_text().splitlines()[: args.prompts]
    model, tok, _ = load_model_and_tokenizer(args.model)
    t0 = time.perf_counter()
    res = bf16_agreement(model, tok, prompts, args.tokens, num_blocks=128)
    secs = time.perf_counter() - t0
    print(f"{len(prompts)} chat prompts, {args.tokens} greedy tokens, reference: zeal fp32 ({secs:.0f} s)")
    print(f"{'path':<14}{'median first divergence':>25}{'diverge < 8':>13}{'identical':>11}")
    for name, r in res.items():
        print(f"{'bf16 ' + name:<14}{r['median']:>25}{r['early']:>13}{r['identical']:>11}")
        print("   first divergences:", r["divergence"])
    ok = at_least_as_close(res["fused"], res["torch"])
    print(f"fused at least as close to fp32 as torch bf16: {ok}")
    if args.out:
        figures = {k: {n: v for n, v in r.items() if n != "tokens"} for k, r in res.items()}
        Path(args.out).write_text(json.dumps({"max_tokens": args.tokens, **figures}, indent=1))


if __name__ == "__main__":
    main()
