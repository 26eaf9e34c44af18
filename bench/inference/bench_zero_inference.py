"""ZeRO-Inference on this machine: SmolLM2-135M-Instruct served with its decoder layers
streamed from layer files under resident-weight budgets of 25 % and 50 % of the model,
beside the same model fully resident, in one run.

For each budget it prints tokens/s, the streamed bytes per forward pass, the mean pass
time, and the pass time's lower bound: streamed bytes / the read bandwidth that ``dd``
measures on the same layer files in the same run (from the page cache when the files are
cached, as they are after the first pass here; ``--drop-cache`` asks the kernel to drop
them before each dd and each pass, where permitted). Greedy output is checked equal to
resident serving.

    python bench/inference/bench_zero_inference.py [--dtype bfloat16] [--requests 8] [--tokens 32]
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from zeal.inference.llm import LLM, resolve_model_path
from zeal.inference.sampling_params import SamplingParams

GB = 1 << 30


def dd_bandwidth(files: list[Path], tmp: str) -> float:
    """Bytes/s of one ``dd`` (1 MiB blocks) reading the layer files' bytes, laid end to end
    in one file (so the figure is not per-process start-up), read once before to be in the
    same cache state as the streamer's files."""
    whole = Path(tmp) / "all-layers.bin"
    with open(whole, "wb") as out:
        for f in files:
            out.write(f.read_bytes())
    subprocess.run(["dd", f"if={whole}", "of=/dev/null", "bs=1M"], check=True, capture_output=True)
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={whole}", "of=/dev/null", "bs=1M"], check=True, capture_output=True)
    bw = whole.stat().st_size / (time.perf_counter() - t0)
    whole.unlink()
    return bw


def run(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], float, float]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    return [o.outputs[0].token_ids for o in outs], len(prompts) * tokens / dt, dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--fractions", default="0.25,0.5")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    path = resolve_model_path(None)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 20000, (int(n),), generator=g).tolist()
               for n in torch.randint(16, 96, (args.requests,), generator=g)]
    resident = LLM(path, dtype=dtype, num_blocks=256, block_size=16)
    model = resident.engine.runner.model
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    want, res_tps, res_dt = run(resident, prompts, args.tokens)
    del resident, model
    print(f"SmolLM2-135M-Instruct {args.dtype}: {model_bytes / 1e6:.1f} MB of weights; {args.requests} requests x "
          f"{args.tokens} new tokens, greedy, {torch.get_num_threads()} threads")
    print(f"resident: {res_tps:.1f} tok/s ({res_dt:.2f} s)")
    print("| budget | slots | resident MB | streamed MB/pass | pass ms | bound ms (dd) | bound/pass | tok/s | "
          "tok/s vs resident | same tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for frac in [float(f) for f in args.fractions.split(",")]:
            llm = LLM(path, dtype=dtype, num_blocks=256, block_size=16, weights_offload="disk",
                      max_resident_weights_gb=frac * model_bytes / GB, offload_dir=f"{tmp}/layers")
            streamer = llm.engine.runner.model.weight_streamer
            st = streamer.stats
            got, tps, dt = run(llm, prompts, args.tokens)
            reads0, bytes0 = st.reads, st.bytes_read
            got, tps, dt = run(llm, prompts, args.tokens)
            passes = (st.reads - reads0) / max(len(streamer.streamed), 1)  # every streamed layer once a pass
            per_pass = (st.bytes_read - bytes0) / max(passes, 1)
            bw = dd_bandwidth(sorted(Path(f"{tmp}/layers").glob("layer*.bin")), tmp)
            pass_ms, bound_ms = dt / max(passes, 1) * 1e3, per_pass / bw * 1e3
            print(f"| {frac:.0%} | {st.slots} | {st.resident_bytes / 1e6:.1f} | {per_pass / 1e6:.1f} | {pass_ms:.1f} | "
                  f"{bound_ms:.2f} ({bw / 1e9:.1f} GB/s) | {bound_ms / pass_ms:.2f} | {tps:.1f} | "
                  f"{tps / res_tps:.2f}x | {got == want} |")
            llm.engine.runner.model.weight_streamer.close()


if __name__ == "__main__":
    main()
