"""Serving speed of SmolLM2-135M-Instruct: the dense folder, its int8 per-channel
compressed-tensors folder dequantized on load, and the same folder with int8 weight-only
matmuls (``quantized_matmul="int8"``): tokens/s of greedy requests and model bytes resident.

    flock /tmp/zeal-heavy.lock python bench/compression/bench_serve_compressed.py --requests 16 --tokens 32
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch


def write_int8_folder(src: Path, out: Path) -> Path:
    """``src``'s model as an int8 per-channel compressed-tensors folder (RTN, lm_head left dense)."""
    from zeal.compression.export import export_compressed
    from zeal.compression.modules import linear_targets
    from zeal.models.hf import load_hf_model, save_hf_folder

    model, _ = load_hf_model(src, torch.float32)
    targets = [n for n in linear_targets(model) if n != "lm_head"]
    save_hf_folder(model, out)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "generation_config.json"):
            shutil.copy(f, out / f.name)
    return export_compressed(out, {n: (8, None) for n in targets}, ignore=["lm_head"])


def resident_bytes(llm) -> tuple[int, int]:
    """(model parameters + buffers, oneDNN-packed weight copies) in bytes."""
    m = llm.engine.runner.model
    seen, total = set(), 0
    for t in list(m.parameters()) + list(m.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    packed = llm.engine.runner.packed
    return total, packed.nbytes if packed is not None else 0


def run_one(folder: Path, dtype: str, mode: str, prompts: list[str], tokens: int) -> dict:
    from zeal.inference import LLM, SamplingParams

    llm = LLM(str(folder), dtype=dtype, quantized_matmul=mode)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    model_b, packed_b = resident_bytes(llm)
    return {"tok_s": n / dt, "model_mb": model_b / 2**20, "packed_mb": packed_b / 2**20,
            "tokens": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    args = ap.parse_args()
    from zeal.models.hf import default_model_path

    src = default_model_path()
    prompts = [f"Question {i}: in two sentences, what is a {w}?" for i, w in
               enumerate(["compiler", "kernel", "cache", "thread", "socket", "matrix", "graph", "queue"] * 8)]
    prompts = prompts[: args.requests]
    with tempfile.TemporaryDirectory() as tmp:
        int8 = write_int8_folder(src, Path(tmp) / "int8")
        for dtype in args.dtypes.split(","):
            rows = {"dense": run_one(src, dtype, "off", prompts, args.tokens),
                    "int8 dequantized": run_one(int8, dtype, "off", prompts, args.tokens),
                    "int8 matmul": run_one(int8, dtype, "int8", prompts, args.tokens)}
            base = rows["dense"]["tok_s"]
            same = rows["int8 matmul"]["tokens"] == rows["int8 dequantized"]["tokens"]
            print(f"{dtype}, {args.requests} requests x {args.tokens} tokens, {torch.get_num_threads()} threads; "
                  f"int8 matmul greedy tokens == dequantized: {same}")
            for name, r in rows.items():
                print(f"  {name:18s} {r['tok_s']:8.1f} tok/s ({r['tok_s'] / base:.2f}x dense)  "
                      f"model {r['model_mb']:7.1f} MiB + packed copies {r['packed_mb']:6.1f} MiB")


if __name__ == "__main__":
    main()
