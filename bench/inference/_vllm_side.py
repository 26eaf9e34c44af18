"""The vLLM side of ``bench_serving.py --vllm PYTHON``: run inside vLLM's own virtual
environment (never a zeal dependency), on the same prompts (token ids) and model folder.

Reads a JSON job from ``argv[1]`` and writes per-request timings to ``argv[2]``:
``{"wall_s": ..., "requests": [{"prompt_len", "ttft_s", "tokens", "decode_s"}, ...]}``.
TTFT is vLLM's own ``first_token_latency`` (arrival to first token); the decode time is
last minus first token time stamp of the engine core. All requests are queued at once
(``LLM.generate`` on the whole list), greedy, ``ignore_eos``.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    job = json.loads(open(sys.argv[1]).read())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job.get("kv_gb", 4)))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=job["model"], dtype=job["dtype"], skip_tokenizer_init=True, disable_log_stats=False,
              max_model_len=job.get("max_model_len", 1024), seed=0, enforce_eager=job.get("enforce_eager", False))
    params = SamplingParams(max_tokens=job["new_tokens"], temperature=0.0, ignore_eos=True, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, detokenize=False),
                 use_tqdm=False)  # warm-up, as the zeal side has
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    rows = []
    for o in outs:
        m = o.metrics
        rows.append({"prompt_len": len(o.prompt_token_ids), "tokens": len(o.outputs[0].token_ids),
                     "ttft_s": m.first_token_latency if m else None,
                     "decode_s": (m.last_token_ts - m.first_token_ts) if m else None,
                     "token_ids": list(o.outputs[0].token_ids)})
    with open(sys.argv[2], "w") as f:
        json.dump({"wall_s": wall, "requests": rows}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
