"""Multi-LoRA serving throughput: 1, 4 and 16 adapters mixed in one batch vs the base model alone.

    flock -w 1500 /tmp/zeal-cpu.lock python bench/inference/bench_multilora.py [--dtype fp32] \
        [--seqs 32] [--prompt-tokens 64] [--tokens 32] [--threads 2]

SmolLM2-135M (zeal.models.hf.default_model_path()), random rank-8 adapters on q, k, v and o
(PEFT folders written by zeal.lora.peft_folder, B not zero), greedy, ``ignore_eos``. Each
case runs ``--seqs`` requests at once through one engine (continuous batching: every
pass mixes the requests' adapters, round-robin over the adapters), after a warm-up run of
the same case; printed: generated tokens/s and the ratio to the base model alone (the
issue's target: >= 0.8x with 4 adapters). ``base, LoRA on`` is the base model's requests
through an engine that serves adapters (what an adapter-less request pays: nothing).
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch

from zeal.config.inference import EngineConfig, LoRAServingConfig, resolve_dtype
from zeal.inference.engine import LLMEngine
from zeal.inference.sampling_params import SamplingParams
from zeal.lora.peft_folder import LoraPair, PeftAdapter, PeftLoraConfig, write_adapter
from zeal.models.hf import default_model_path, load_hf_model

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def random_adapters(model, n: int, rank: int, root: Path) -> list[str]:
    """``n`` random PEFT folders of rank ``rank`` on q, k, v, o of every layer."""
    linears = {name: m for name, m in model.named_modules() if name.split(".")[-1] in TARGETS}
    paths = []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        lora = {name: LoraPair(torch.randn(rank, m.in_features, generator=g) * 0.02,
                               torch.randn(m.out_features, rank, generator=g) * 0.02, 2.0)
                for name, m in linears.items()}
        cfg = PeftLoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(TARGETS))
        paths.append(str(write_adapter(root / f"a{i}", PeftAdapter(cfg, lora))))
    return paths


def run_case(model, prompts, params, ecfg: EngineConfig, names: list[str | None]) -> tuple[float, int]:
    """(generated tokens/s, tokens) of ``prompts`` at once, request ``i`` on ``names[i % len]``."""
    engine = LLMEngine(model, None, ecfg)
    for warm in (True, False):
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add_request(f"{warm}{i}", p, params, lora_name=names[i % len(names)])
        n = 0
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    n += len(o.outputs[0].token_ids)
        dt = time.perf_counter() - t0
    return n / dt, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto", help="fp32, bf16 or auto (bf16 where the CPU computes it natively)")
    ap.add_argument("--seqs", type=int, default=32, help="requests in flight at once")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32, help="tokens generated per request")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, resolve_dtype({"fp32": "float32", "bf16": "bfloat16"}.get(args.dtype, args.dtype), "cpu"))
    model, _ = load_hf_model(default_model_path(), dtype)
    model.eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, model.config.vocab_size, (args.prompt_tokens,), generator=g).tolist()
               for _ in range(args.seqs)]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    blocks = args.seqs * -(-(args.prompt_tokens + args.tokens) // 64) + 8  # 64-token blocks on CPU
    base_cfg = {"max_num_seqs": args.seqs, "max_num_batched_tokens": 512, "enable_prefix_caching": False,
                "block_size": 64, "num_blocks": blocks}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = random_adapters(model, 16, args.rank, Path(tmp))
        lcfg = LoRAServingConfig(lora_modules=[f"a{i}={p}" for i, p in enumerate(paths)], max_loras=16,
                                 max_lora_rank=args.rank)
        cases = [("base model alone", EngineConfig(**base_cfg), [None]),
                 ("base, LoRA on", EngineConfig(**base_cfg, lora=lcfg), [None])]
        cases += [(f"{k} adapter{'s' if k > 1 else ''} mixed", EngineConfig(**base_cfg, lora=lcfg),
                   [f"a{i}" for i in range(k)]) for k in (1, 4, 16)]
        base_tps = None
        print(f"SmolLM2-135M {str(dtype).removeprefix('torch.')}, {args.threads} threads, {args.seqs} requests x "
              f"({args.prompt_tokens} prompt + {args.tokens} generated tokens), rank-{args.rank} adapters on q,k,v,o")
        for label, ecfg, names in cases:
            tps, n = run_case(model, prompts, params, ecfg, names)
            gc.collect()  # the previous engine's KV cache and packed weights
            base_tps = base_tps or tps
            rows.append({"case": label, "tokens_per_s": round(tps, 1), "vs_base": round(tps / base_tps, 3),
                         "tokens": n})
            print(f"  {label:<22} {tps:8.1f} tok/s   {tps / base_tps:5.2f}x base")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "dtype": str(dtype), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
