"""Speculative decoding (prompt lookup or a draft model): speed-up and acceptance on code and chat prompts.

    flock /tmp/zeal-heavy.lock python bench/inference/bench_speculative.py [--dtype bf16] [--tokens 128]
    flock /tmp/zeal-heavy.lock python bench/inference/bench_speculative.py --method draft_model \
        --draft-layers 4 --sets "code completion,chat"

SmolLM2-135M-Instruct (the embedded model), greedy. Three prompt sets: code edits asked
in chat ("add type hints to this function" — the answer copies the prompt's code), raw
code completion, and plain chat questions. Each set runs one request at a time (where
drafts pay most) and all at once, with and without ``speculative_config={"method":
"ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4, "prompt_lookup_min": 2}``;
printed: tokens/s, the speed-up, the draft acceptance rate and whether every output equals
the plain greedy one.

``--method draft_model``: ``{"method": "draft_model", "model": DRAFT, "num_speculative_tokens":
K}``. No smaller model of SmolLM2's tokenizer is available offline, so the draft is
SmolLM2-135M's own first ``--draft-layers`` decoder layers with its embeddings, final norm
and head (:func:`zeal.inference.draft_model.first_layers`): a cheap but weak draft (the
head alone is ~a fifth of the model's weights), not a trained small sibling; with all 30 layers
the target drafts for itself (acceptance 1.0: what the mechanism costs at best).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from zeal.inference import LLM, SamplingParams

FUNCS = [
    "def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)\n",
    "def count_words(text):\n    counts = {}\n    for word in text.split():\n        word = word.lower()\n"
    "        counts[word] = counts.get(word, 0) + 1\n    return counts\n",
    "def clamp(value, low, high):\n    if value < low:\n        return low\n    if value > high:\n        return high\n"
    "    return value\n",
    "def read_lines(path):\n    with open(path) as f:\n        lines = f.readlines()\n    return [line.strip() for line in lines]\n",
    "def fizzbuzz(n):\n    out = []\n    for i in range(1, n + 1):\n        if i % 15 == 0:\n            out.append('FizzBuzz')\n"
    "        elif i % 3 == 0:\n            out.append('Fizz')\n        elif i % 5 == 0:\n            out.append('Buzz')\n"
    "        else:\n            out.append(str(i))\n    return out\n",
    "def merge(a, b):\n    result = dict(a)\n    for key, value in b.items():\n        result[key] = value\n    return result\n",
    "def is_prime(n):\n    if n < 2:\n        return False\n    for d in range(2, int(n ** 0.5) + 1):\n        if n % d == 0:\n"
    "            return False\n    return True\n",
    "def flatten(items):\n    out = []\n    for item in items:\n        if isinstance(item, list):\n            out.extend(flatten(item))\n"
    "        else:\n            out.append(item)\n    return out\n",
]
ASKS = ["Add type hints to this Python function and return the full code.",
        "Add a docstring to this Python function and return the full code.",
        "Rename the function to snake_case with a clearer name and return the full code."]
CHAT = ["What is the capital of France?", "Explain photosynthesis in two sentences.", "Write a haiku about autumn.",
        "Give me a tip for sleeping better.", "Why is the sky blue?", "How do I make a cup of tea?",
        "What does a CPU do?", "List three fruits that are red."]


def prompt_sets(tok) -> dict[str, list[list[int]]]:
    edits = [tok.encode_chat([{"role": "user", "content": f"{ASKS[i % 3]}\n\n```python\n{f}```"}])
             for i, f in enumerate(FUNCS)]
    completion = [tok.encode("# utilities\n\n" + FUNCS[i] + "\n\n" + FUNCS[(i + 1) % 8] + "\n\ndef ")
                  for i in range(len(FUNCS))]
    chat = [tok.encode_chat([{"role": "user", "content": c}]) for c in CHAT]
    return {"code edits (chat)": edits, "code completion": completion, "chat": chat}


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, one_at_a_time: bool):
    t0 = time.perf_counter()
    outs = ([llm.generate([p], params)[0] for p in prompts] if one_at_a_time else llm.generate(prompts, params))
    secs = time.perf_counter() - t0
    toks = [o.outputs[0].token_ids for o in outs]
    return toks, sum(map(len, toks)) / secs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--out", default=None)
    ap.add_argument("--method", default="ngram", choices=["ngram", "draft_model"])
    ap.add_argument("--draft-layers", type=int, default=4, help="draft_model: the target's first N layers")
    ap.add_argument("--sets", default=None, help="comma-separated prompt sets (default: all)")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    plain = LLM(None, dtype=dtype, num_blocks=64)
    if args.method == "draft_model":
        from zeal.inference.draft_model import first_layers

        target = plain.engine.runner.model  # --draft-layers 30 (all): the target drafts for itself
        draft = target if args.draft_layers >= target.num_layers else first_layers(target, args.draft_layers)
        spec = {"method": "draft_model", "num_speculative_tokens": args.k, "model": draft}
    fast = LLM(plain.engine.runner.model, plain.tokenizer, eos_token_ids=sorted(plain.engine.eos_token_ids),
               num_blocks=64, speculative_config=spec)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0)
    rows = []
    draft = f", draft: its first {args.draft_layers} layers" if args.method == "draft_model" else ""
    print(f"SmolLM2-135M-Instruct {args.dtype}, greedy, {args.tokens} new tokens, {args.method} k={args.k}{draft}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'prompt set':<20}{'mode':<12}{'plain tok/s':>12}{'spec tok/s':>12}{'speed-up':>10}"
          f"{'accepted':>10}{'identical':>11}{'plain vs plain 1-by-1':>23}")
    wanted = args.sets.split(",") if args.sets else None
    for name, prompts in prompt_sets(plain.tokenizer).items():
        if wanted is not None and name not in wanted:
            continue
        single = None
        for one in (True, False):
            run(plain, prompts[:1], params, True)  # warm-up
            ref, base = run(plain, prompts, params, one)
            m = fast.engine.metrics
            d0, a0 = m.spec_draft_tokens_total, m.spec_accepted_tokens_total
            got, tps = run(fast, prompts, params, one)
            acc = (m.spec_accepted_tokens_total - a0) / max(1, m.spec_draft_tokens_total - d0)
            same = sum(a == b for a, b in zip(ref, got))
            single = single or ref  # bf16 GEMMs round by batch shape: plain greedy varies with the batch too
            plain_same = sum(a == b for a, b in zip(ref, single))
            mode = "one by one" if one else "all at once"
            print(f"{name:<20}{mode:<12}{base:>12.1f}{tps:>12.1f}{tps / base:>9.2f}x{acc:>10.2f}"
                  f"{f'{same}/{len(ref)}':>11}{f'{plain_same}/{len(ref)}':>23}")
            rows.append({"set": name, "mode": mode, "plain_tok_s": base, "spec_tok_s": tps,
                         "acceptance": acc, "identical": same, "plain_vs_plain_single": plain_same,
                         "prompts": len(ref)})
    if args.out:
        Path(args.out).write_text(json.dumps({"dtype": args.dtype, "k": args.k, "method": args.method,
                                              "draft_layers": args.draft_layers, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
