"""Tensor-parallel serving throughput: ``LLM(path, tensor_parallel_size=T)`` beside T = 1 on
the same requests, same cores.

    flock /tmp/zeal-heavy.lock python bench/inference/bench_tp_serving.py [--model PATH] [--dtype bf16]
        [--requests 16] [--new-tokens 32] [--sizes 1,2]

Default model: GPT-2-small with random weights (124M; 12 heads split 6 + 6 — SmolLM2-135M's
9 heads and 3 key/value heads do not divide by 2), built from its config. Requests: random token prompts of 42-128
tokens, greedy, ``ignore_eos``, all queued at once. zeal splits the threads of the process
between its ranks (T ranks of ``threads // T`` each), so every size uses the same cores.
Printed per size: generated tokens/s, the time of the whole batch, and how many requests'
greedy tokens equal T = 1's (rounding differs with the split: row-parallel sums are added
in another order, so a near-tie may flip in 16-bit).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from zeal.inference import LLM, SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (int(torch.randint(42, 129, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF folder (default: a random GPT-2-small)")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--sizes", default="1,2")
    a = ap.parse_args()
    tmp = tempfile.TemporaryDirectory()
    if a.model is None:
        from bench_serving import gpt2_small_folder

        a.model = str(gpt2_small_folder(Path(tmp.name)))
    params = SamplingParams(max_tokens=a.new_tokens, temperature=0.0, ignore_eos=True)
    ref, rows, threads = None, [], torch.get_num_threads()  # tensor parallelism splits them between its ranks
    for size in (int(s) for s in a.sizes.split(",")):
        llm = LLM(a.model, dtype=a.dtype, tensor_parallel_size=size, num_blocks=256)
        try:
            prompts = _prompts(a.requests, llm.engine.vocab_size)
            llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            secs = time.perf_counter() - t0
        finally:
            llm.shutdown()
        toks = [o.outputs[0].token_ids for o in outs]
        ref = ref or toks
        same = sum(x == y for x, y in zip(toks, ref))
        rows.append((size, sum(map(len, toks)) / secs, secs, same))
    print(f"{Path(a.model).name} {a.dtype}, {a.requests} requests x {a.new_tokens} new tokens, "
          f"prompts 42-128, {threads} threads in all")
    print("| TP | tok/s | batch s | vs TP 1 | greedy tokens equal to TP 1 |")
    print("|---:|---:|---:|---:|---:|")
    for size, tps, secs, same in rows:
        print(f"| {size} | {tps:.1f} | {secs:.2f} | {tps / rows[0][1]:.2f}x | {same}/{a.requests} |")


if __name__ == "__main__":
    main()
