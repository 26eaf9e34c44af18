"""Serving benchmark: zeal's engine (SplitFuse, paged KV) beside Hugging Face ``generate``.

Workload (FastGen-style): N requests, prompt lengths uniform in [min, max] tokens,
a fixed number of new tokens (EOS ignored), arriving all at once or as a Poisson
stream. Figures: throughput, p50/p99 time to first token (TTFT), p50/p99 time per
output token (TPOT), and effective throughput (FastGen's SLA: TTFT <= prompt/512 s
and the EMA, span 16, of per-token latencies always < 1/R s, R in {2, 4} tokens/s).
Peers, measured in the same run on the all-at-once workload: HF ``generate`` one
request at a time, static batches of 8 with left padding, and (``--vllm PYTHON``) vLLM's
CPU build run from its own virtual environment by ``_vllm_side.py`` on the same token ids
and model folder (its TTFT and per-request decode span are vLLM's own request metrics;
its effective-throughput columns are not computed, since per-token times are not kept).

    python bench/inference/bench_serving.py                 # full: 64 requests, 32-512 prompt, 128 new
    python bench/inference/bench_serving.py --quick         # a small smoke run
    python bench/inference/bench_serving.py --requests 32 --prompt-min 42 --prompt-max 248 --new-tokens 64 \
        --threads 2 --dtype bf16 --vllm /work/peers/vllm/bin/python   # beside vLLM, equal cores
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from zeal.inference import SamplingParams  # noqa: E402
from zeal.inference.engine import EngineConfig, LLMEngine  # noqa: E402
from zeal.inference.llm import load_model_and_tokenizer  # noqa: E402
from zeal.inference.packed_linear import packed_linears_for  # noqa: E402
from zeal.utils.process import apply_process_settings  # noqa: E402

apply_process_settings()  # as `zeal serve` does (huge pages), before any tensor


@dataclass
class Trace:
    """Client-side timings of one request."""

    prompt_len: int
    arrival: float
    token_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def tpot(self) -> float:
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else 0.0

    def meets_sla(self, rate: float) -> bool:
        if self.ttft > self.prompt_len / 512:
            return False
        ema, alpha = None, 2 / 17
        for a, b in zip(self.token_times, self.token_times[1:]):
            lat = b - a
            ema = lat if ema is None else alpha * lat + (1 - alpha) * ema
            if ema >= 1 / rate:
                return False
        return True


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


def summarize(name: str, traces: list[Trace]) -> dict:
    start = min(t.arrival for t in traces)
    end = max(t.token_times[-1] for t in traces)
    toks = sum(len(t.token_times) for t in traces)
    rps = len(traces) / (end - start)
    out = {
        "system": name, "requests": len(traces), "wall_s": end - start, "tok_per_s": toks / (end - start),
        "req_per_s": rps,
        "ttft_p50_s": pct([t.ttft for t in traces], 50), "ttft_p99_s": pct([t.ttft for t in traces], 99),
        "tpot_p50_ms": 1e3 * pct([t.tpot for t in traces], 50), "tpot_p99_ms": 1e3 * pct([t.tpot for t in traces], 99),
    }
    for r in (2, 4):
        ok = sum(t.meets_sla(r) for t in traces)
        out[f"eff_req_per_s_R{r}"] = rps * ok / len(traces)
    return out


def workload(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_zeal(model, prompts, new_tokens, arrivals, budget, kv_mb, block_size=None) -> list[Trace]:
    engine = LLMEngine(model, None, EngineConfig(block_size=block_size, kv_cache_bytes=kv_mb << 20,
                                                 max_num_batched_tokens=budget, max_num_seqs=64))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    traces = [Trace(len(p), t0 + a) for p, a in zip(prompts, arrivals)]
    order = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    nxt, done = 0, 0
    while done < len(prompts):
        now = time.perf_counter()
        while nxt < len(order) and traces[order[nxt]].arrival <= now:
            i = order[nxt]
            engine.add_request(str(i), prompts[i], params)
            nxt += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, traces[order[nxt]].arrival - now))
            continue
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            traces[int(o.request_id)].token_times += [now] * len(o.outputs[0].delta_token_ids)
            traces[int(o.request_id)].token_ids += list(o.outputs[0].delta_token_ids)
            done += o.finished
    return traces


class _Clock:
    """A logits processor that only timestamps every decoding step of HF ``generate``."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def matmul_floor(model, prompts, new_tokens: int, budget: int, max_seqs: int = 64) -> float:
    """Seconds the workload's matrix products alone take on this machine: every Linear
    of the model (the vocabulary head only for sampled rows) timed at the engine's
    pass shapes (``budget`` prompt tokens; one decode token per running sequence),
    times the number of such passes. Attention, norms and everything else excluded,
    so no engine on this CPU can serve the workload faster (a lower bound)."""
    from torch import nn

    head = getattr(model, "lm_head", None)
    body = [m.weight for m in model.modules() if isinstance(m, nn.Linear) and m is not head]
    head_w = head.weight if head is not None else model.transformer.wte.weight

    packed = packed_linears_for(model, torch.device("cpu"), head_w.dtype) is not None

    def timed(rows: int, weights) -> float:
        xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights}
        if packed:  # the product zeal's fp32 engine runs (oneDNN on weights reordered once)
            ws = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
            mm = [functools.partial(torch.ops.mkldnn._linear_pointwise, xs[w.shape[1]], pw, None, "none", [], "")
                  for w, pw in zip(weights, ws)]
        else:
            mm = [functools.partial(torch.nn.functional.linear, xs[w.shape[1]], w) for w in weights]
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for f in mm:
                f()
            best = min(best, time.perf_counter() - t)
        return best

    with torch.inference_mode():
        prefill = math.ceil(sum(map(len, prompts)) / budget) * timed(budget, body)
        prefill += len(prompts) * timed(1, [head_w])
        batch = min(len(prompts), max_seqs)
        waves = math.ceil(len(prompts) / max_seqs)
        decode = waves * (new_tokens - 1) * (timed(batch, body) + timed(batch, [head_w]))
    return prefill + decode


def run_hf(hf, prompts, new_tokens, batch: int) -> list[Trace]:
    from transformers import LogitsProcessorList

    t0 = time.perf_counter()
    traces = [Trace(len(p), t0) for p in prompts]
    pad = 0
    for s in range(0, len(prompts), batch):
        group = prompts[s : s + batch]
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        clock = _Clock()
        with torch.no_grad():
            hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                        do_sample=False, pad_token_id=pad, logits_processor=LogitsProcessorList([clock]))
        for j in range(len(group)):
            traces[s + j].token_times = list(clock.times)
    return traces


def run_vllm(python: str, folder: Path, prompts, new_tokens: int, dtype: str, threads: int,
             reserved_cpus: int) -> tuple[dict, list[list[int]]]:
    """vLLM's CPU build on the same prompts, in its own interpreter (``_vllm_side.py``):
    the summary row (throughput over ``LLM.generate``'s wall time) and its greedy tokens."""
    import os
    import subprocess

    with tempfile.TemporaryDirectory() as tmp:
        job, out = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job.write_text(json.dumps({"model": str(folder), "prompts": prompts, "new_tokens": new_tokens,
                                   "dtype": {"fp32": "float32", "bf16": "bfloat16"}[dtype]}))
        env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU=str(reserved_cpus),
                   VLLM_CPU_OMP_THREADS_BIND="0" if threads == 1 else "auto")
        side = Path(__file__).with_name("_vllm_side.py")
        proc = subprocess.run([python, str(side), str(job), str(out)], env=env, timeout=1800,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"vLLM side failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
        res = json.loads(out.read_text())
    traces = []
    for r in res["requests"]:
        n = r["tokens"]
        step = r["decode_s"] / max(1, n - 1)
        traces.append(Trace(r["prompt_len"], 0.0, [r["ttft_s"] + i * step for i in range(n)], r["token_ids"]))
    row = summarize(f"vLLM {reserved_cpus} core(s) reserved", traces)
    toks = sum(r["tokens"] for r in res["requests"])
    row.update(wall_s=res["wall_s"], tok_per_s=toks / res["wall_s"], req_per_s=len(traces) / res["wall_s"],
               eff_req_per_s_R2=float("nan"), eff_req_per_s_R4=float("nan"))
    return row, [t.token_ids for t in traces]


def first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first differing token (the common length when one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def gpt2_small_folder(tmp: Path) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(n_positions=1024, n_embd=768, n_layer=12, n_head=12, vocab_size=50257))
    m.save_pretrained(tmp / "gpt2-small-random")
    return tmp / "gpt2-small-random"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-min", type=int, default=32)
    ap.add_argument("--prompt-max", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--budget", type=int, default=512, help="SplitFuse token budget per pass")
    ap.add_argument("--kv-mb", type=int, default=2048, help="zeal's KV cache (2 GB holds the 64 requests in fp32 too)")
    ap.add_argument("--block-size", type=int, default=None, help="KV block size (default: the engine's)")
    ap.add_argument("--poisson-load", type=float, default=0.7,
                    help="Poisson arrival rate as a fraction of the all-at-once request throughput")
    ap.add_argument("--models", default="smollm2,gpt2-small")
    ap.add_argument("--no-hf", action="store_true", help="skip the Hugging Face peers")
    ap.add_argument("--hf-sequential-requests", type=int, default=None,
                    help="run HF one-at-a-time on only the first K requests (it is the slowest peer)")
    ap.add_argument("--quick", action="store_true", help="8 requests, 32-128 prompt, 16 new tokens")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared machine OpenMP spinning with more collapses)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                    help="weights and compute of both systems (zeal's KV cache follows)")
    ap.add_argument("--json", default=None, help="write the figures to this file")
    ap.add_argument("--vllm", default=None, metavar="PYTHON",
                    help="the python of a virtual environment with vllm-cpu: run vLLM beside zeal")
    ap.add_argument("--vllm-reserved-cpus", type=int, default=0,
                    help="VLLM_CPU_NUM_OF_RESERVED_CPU (0: vLLM's model runs on every core, as zeal's)")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.prompt_min, args.prompt_max, args.new_tokens = 8, 32, 128, 16
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            path = None if name == "smollm2" else gpt2_small_folder(Path(tmp))
            model, tok, _ = load_model_and_tokenizer(path, dtype)
            from zeal.inference.llm import resolve_model_path

            vocab = model.config.vocab_size
            prompts = workload(args.requests, args.prompt_min, args.prompt_max, vocab, seed=0)
            print(f"\n== {name}: {args.requests} requests, prompts {args.prompt_min}-{args.prompt_max} tokens "
                  f"(mean {statistics.mean(map(len, prompts)):.0f}), {args.new_tokens} new tokens, "
                  f"{torch.get_num_threads()} threads, {args.dtype}", flush=True)
            rows = []
            run_zeal(model, prompts[:2], 2, [0.0, 0.0], args.budget, args.kv_mb, args.block_size)  # warm-up
            traces = run_zeal(model, prompts, args.new_tokens, [0.0] * len(prompts), args.budget, args.kv_mb,
                              args.block_size)
            z = summarize("zeal all-at-once", traces)
            rows.append(z)
            print(json.dumps(z), flush=True)
            v = None
            if args.vllm:
                folder = resolve_model_path(path)
                v, v_ids = run_vllm(args.vllm, folder, prompts, args.new_tokens, args.dtype, args.threads,
                                    args.vllm_reserved_cpus)
                div = [first_divergence(t.token_ids, ids) for t, ids in zip(traces, v_ids)]
                v["greedy_same_requests"] = sum(d == args.new_tokens for d in div)
                v["first_divergence_median"] = statistics.median(div)
                rows.append(v)
                print(json.dumps(v), flush=True)
            rate = args.poisson_load * z["req_per_s"]
            rng = random.Random(1)
            t, arrivals = 0.0, []
            for _ in prompts:
                t += rng.expovariate(rate)
                arrivals.append(t)
            zp = summarize(f"zeal poisson {rate:.2f} req/s", run_zeal(model, prompts, args.new_tokens, arrivals,
                                                                     args.budget, args.kv_mb, args.block_size))
            rows.append(zp)
            print(json.dumps(zp), flush=True)
            if not args.no_hf:
                hf = AutoModelForCausalLM.from_pretrained(resolve_model_path(path), dtype=dtype).eval()
                hs = summarize("HF static batch 8", run_hf(hf, prompts, args.new_tokens, 8))
                rows.append(hs)
                print(json.dumps(hs), flush=True)
                k = args.hf_sequential_requests or len(prompts)
                h1 = summarize(f"HF one at a time ({k} req)", run_hf(hf, prompts[:k], args.new_tokens, 1))
                rows.append(h1)
                print(json.dumps(h1), flush=True)
                del hf
            print(f"\n{name}: {'system':<30} {'tok/s':>8} {'req/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
                  f"{'TPOT p50':>9} {'TPOT p99':>9} {'eff R2':>7} {'eff R4':>7}")
            for r in rows:
                print(f"{'':<{len(name) + 1}} {r['system']:<30} {r['tok_per_s']:8.1f} {r['req_per_s']:7.3f} "
                      f"{r['ttft_p50_s']:8.2f}s {r['ttft_p99_s']:8.2f}s {r['tpot_p50_ms']:7.0f}ms "
                      f"{r['tpot_p99_ms']:7.0f}ms {r['eff_req_per_s_R2']:7.3f} {r['eff_req_per_s_R4']:7.3f}")
            floor = matmul_floor(model, prompts, args.new_tokens, args.budget)
            toks = len(prompts) * args.new_tokens
            print(f"  matmul floor: {floor:.1f} s for the workload's matrix products alone "
                  f"(<= {toks / floor:.1f} tok/s for any engine; zeal reaches {z['wall_s'] / floor:.2f}x of it)")
            if v is not None:
                print(f"  zeal/vLLM throughput {z['tok_per_s'] / v['tok_per_s']:.2f}x, TTFT p99 zeal "
                      f"{z['ttft_p99_s']:.2f}s vs vLLM {v['ttft_p99_s']:.2f}s, TPOT p50 zeal {z['tpot_p50_ms']:.0f}ms "
                      f"vs vLLM {v['tpot_p50_ms']:.0f}ms; greedy tokens equal on {v['greedy_same_requests']}/"
                      f"{len(prompts)} requests (median first divergence {v['first_divergence_median']})")
            if not args.no_hf:
                print(f"  zeal/static-8 throughput {z['tok_per_s'] / hs['tok_per_s']:.2f}x "
                      f"(at most {toks / floor / hs['tok_per_s']:.2f}x for an engine that only multiplies), "
                      f"zeal/one-at-a-time {z['tok_per_s'] / h1['tok_per_s']:.2f}x, "
                      f"TTFT p99 zeal {z['ttft_p99_s']:.1f}s vs static-8 {hs['ttft_p99_s']:.1f}s")
            results.append({"model": name, "rows": rows, "args": vars(args)})
            del model
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
