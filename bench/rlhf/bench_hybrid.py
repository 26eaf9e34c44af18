"""Rollout generation with the hybrid engine (zeal's serving engine, weights synced in place)
against generating with the training module itself (full forwards, no KV cache), for one
GRPO-sized batch of a small Llama; prints both times and the ratio.

    PYTHONPATH=. python bench/rlhf/bench_hybrid.py --prompts 8 --n 4 --new-tokens 32
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4, help="answers per prompt")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()

    import zeal
    from zeal.inference.sampling_params import SamplingParams
    from zeal.models.llama import Llama, LlamaConfig
    from zeal.rlhf.hybrid import HybridEngine

    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=8192, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                              num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                              max_position_embeddings=512))
    engine = zeal.initialize(model, {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
                                     "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}})
    prompts = [torch.randint(0, 8192, (24,)).tolist() for _ in range(args.prompts)]
    hybrid = HybridEngine(engine, kv_cache_bytes=256 << 20)
    params = SamplingParams(n=args.n, max_tokens=args.new_tokens, temperature=1.0, seed=0, ignore_eos=True)
    hybrid.generate(prompts, params)  # warm-up
    hybrid.take_times()
    t0 = time.perf_counter()
    hybrid.generate(prompts, params)
    t_hybrid = time.perf_counter() - t0
    times = hybrid.take_times()
    engine.eval()
    ids = torch.tensor([p for p in prompts for _ in range(args.n)])
    t0 = time.perf_counter()
    with torch.no_grad():
        engine.module.generate(ids, args.new_tokens, temperature=1.0)
    t_plain = time.perf_counter() - t0
    tokens = args.prompts * args.n * args.new_tokens
    print(f"tokens {tokens}: hybrid engine {t_hybrid:.2f} s (sync {times.sync * 1e3:.1f} ms, generate "
          f"{times.generate:.2f} s), training module {t_plain:.2f} s; speed-up {t_plain / t_hybrid:.2f}x")


if __name__ == "__main__":
    main()
