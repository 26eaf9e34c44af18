"""Serving tokens/s per decode mode on CPU (issue 37): async scheduling on/off, the decode step
eager or compiled (``compilation_config``), in one run, modes interleaved per repeat.

Workload: N requests of the same prompt length arriving at once, greedy, a fixed number of
new tokens (EOS ignored), so that every decode step runs one batch-size bucket. Each mode's
greedy tokens are compared with the first mode's. ``zeal`` is imported from ``PYTHONPATH``
first (run it with the main checkout's path and ``--modes sync+eager`` for a "before" figure).

    PYTHONPATH=$PWD python bench/inference/bench_decode_modes.py --dtype bf16 --threads 2
    PYTHONPATH=/work/main python bench/inference/bench_decode_modes.py --modes sync+eager
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[2]))  # after PYTHONPATH: a given checkout wins

from zeal.inference import SamplingParams  # noqa: E402
from zeal.inference.engine import EngineConfig, LLMEngine  # noqa: E402
from zeal.inference.llm import load_model_and_tokenizer  # noqa: E402
from zeal.utils.process import apply_process_settings  # noqa: E402

MODES = {"sync+eager": {}, "async+eager": {"async_scheduling": True},
         "sync+compiled": {"compilation_config": 3}, "async+compiled": {"async_scheduling": True,
                                                                        "compilation_config": 3}}


def run(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds to generate ``new_tokens`` for every prompt at once, and the tokens."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", p, params)
    done: dict[str, list[int]] = {}
    t = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    dt = time.perf_counter() - t
    return dt, [done[f"b{i}"] for i in range(len(prompts))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="sync+eager,async+eager,sync+compiled")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the figures to this file")
    args = ap.parse_args()
    apply_process_settings()
    torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model, _, _ = load_model_and_tokenizer(None, dtype)  # the embedded SmolLM2-135M-Instruct
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (args.prompt,), generator=gen).tolist()
               for _ in range(args.requests)]
    modes = args.modes.split(",")
    engines, warm = {}, {}
    for m in modes:
        engines[m] = LLMEngine(model, None, EngineConfig(kv_cache_bytes=256 << 20, **MODES[m]))
        t = time.perf_counter()
        run(engines[m], prompts, 4)  # warm-up: the decode bucket of the batch compiled here
        warm[m] = round(time.perf_counter() - t, 2)
    times: dict[str, list[float]] = {m: [] for m in modes}
    ref, same = None, {}
    for _ in range(args.repeats):
        for m in modes:
            dt, toks = run(engines[m], prompts, args.new_tokens)
            times[m].append(dt)
            ref = toks if ref is None else ref
            same[m] = sum(int(a == b) for a, b in zip(toks, ref))
    rows = []
    for m in modes:
        tps = [args.requests * args.new_tokens / t for t in times[m]]
        rows.append({"mode": m, "tokens_per_s": [round(x, 1) for x in tps], "median": round(statistics.median(tps), 1),
                     "warmup_s": warm[m], "greedy_same": f"{same[m]}/{args.requests}"})
        print(json.dumps(rows[-1]), flush=True)
    meta = {"requests": args.requests, "prompt": args.prompt, "new_tokens": args.new_tokens, "dtype": args.dtype,
            "threads": args.threads, "zeal": str(Path(sys.modules["zeal"].__file__).parent)}
    print(json.dumps(meta))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
