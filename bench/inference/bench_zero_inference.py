"""ZeRO-Inference on this machine: SmolLM2-135M-Instruct served with its decoder layers
streamed from layer files under resident-weight budgets of 25 % and 50 % of the model,
beside the same model fully resident, in one run.

For each budget it prints tokens/s, the streamed bytes per forward pass, the mean pass
time, and the pass time's lower bound: streamed bytes / the read bandwidth that ``dd``
measures on the same layer files in the same run (from the page cache when the files are
cached, as they are after the first pass here; ``--drop-cache`` asks the kernel to drop
them before each dd and each pass, where permitted). Greedy output is checked equal to
resident serving.

``--quant none,int8,int4`` adds the rows of int8 / int4 weight-only layer files
(``weights_offload_quant``): fewer bytes streamed per pass, dequantized into the slot on
arrival; their greedy output is checked equal to the resident model whose weight
matrices went through the same quantize-dequantize. ``wait ms/pass`` is the time the
forward waited for layers (read + dequantization not hidden behind compute).

    python bench/inference/bench_zero_inference.py [--dtype bfloat16] [--requests 8] [--tokens 32] \
        [--quant none,int8,int4]
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from zeal.inference.llm import LLM, load_model_and_tokenizer, resolve_model_path
from zeal.inference.sampling_params import SamplingParams
from zeal.inference.weight_quant import check_quant, quantize_dequantize_weight

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


def reference_tokens(path: Path, dtype: torch.dtype, quant: str, prompts, tokens: int) -> tuple[list, float]:
    """Greedy tokens and tok/s of the resident model, its decoder-layer weight matrices
    quantize-dequantized as ``quant`` stores them."""
    model, tok, eos = load_model_and_tokenizer(path, dtype)
    bits = check_quant(quant)
    if bits:
        with torch.no_grad():
            for layer in model.layer_stack():
                for p in layer.parameters():
                    if p.dim() == 2:
                        p.data = quantize_dequantize_weight(p.data, bits)
    want, tps, _ = run(LLM(model, tok, eos_token_ids=eos, num_blocks=256, block_size=16), prompts, tokens)
    return want, tps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--fractions", default="0.25,0.5")
    ap.add_argument("--quant", default="none", help="comma-separated: none, int8, int4")
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
    print("| storage | budget | slots | resident MB | streamed MB/pass | pass ms | wait ms/pass | bound ms (dd) | "
          "bound/pass | tok/s | tok/s vs resident | same tokens |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for quant in args.quant.split(","):
            ref = want if quant == "none" else reference_tokens(path, dtype, quant, prompts, args.tokens)[0]
            rows(args, path, dtype, quant, prompts, ref, res_tps, model_bytes, tmp)


def rows(args, path: Path, dtype: torch.dtype, quant: str, prompts, want, res_tps: float, model_bytes: int,
         tmp: str) -> None:
    """One table row per budget for the layer files stored as ``quant``."""
    for frac in [float(f) for f in args.fractions.split(",")]:
        llm = LLM(path, dtype=dtype, num_blocks=256, block_size=16, weights_offload="disk",
                  max_resident_weights_gb=frac * model_bytes / GB, offload_dir=f"{tmp}/layers-{quant}",
                  weights_offload_quant=quant)
        streamer = llm.engine.runner.model.weight_streamer
        st = streamer.stats
        got, tps, dt = run(llm, prompts, args.tokens)
        reads0, bytes0, wait0 = st.reads, st.bytes_read, st.wait_s
        got, tps, dt = run(llm, prompts, args.tokens)
        passes = (st.reads - reads0) / max(len(streamer.streamed), 1)  # every streamed layer once a pass
        per_pass = (st.bytes_read - bytes0) / max(passes, 1)
        wait_ms = (st.wait_s - wait0) / max(passes, 1) * 1e3
        bw = dd_bandwidth(sorted(Path(f"{tmp}/layers-{quant}").glob("layer*.bin")), tmp)
        pass_ms, bound_ms = dt / max(passes, 1) * 1e3, per_pass / bw * 1e3
        print(f"| {quant} | {frac:.0%} | {st.slots} | {st.resident_bytes / 1e6:.1f} | {per_pass / 1e6:.1f} | "
              f"{pass_ms:.1f} | {wait_ms:.1f} | {bound_ms:.2f} ({bw / 1e9:.1f} GB/s) | {bound_ms / pass_ms:.2f} | {tps:.1f} | "
              f"{tps / res_tps:.2f}x | {got == want} |")
        llm.engine.runner.model.weight_streamer.close()


if __name__ == "__main__":
    main()
