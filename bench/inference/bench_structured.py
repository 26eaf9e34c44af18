"""Structured outputs: the cost per token of a ``json_schema`` constraint.

    flock /tmp/zeal-heavy.lock python bench/inference/bench_structured.py [--dtype bf16] [--tokens 64]

SmolLM2-135M-Instruct (the embedded model), greedy, chat prompts that ask for a JSON
answer. Each prompt runs without a constraint (``ignore_eos``, so it runs the full
``--tokens``) and with ``structured_outputs={"json": SCHEMA}`` (what ``response_format``
``json_schema`` becomes; it stops when the object is complete), one request at a time
and all at once. Printed: ms per generated token of each and their difference (the
constraint's overhead per token: the llguidance mask computed for each step and applied
to the logits, and the matcher advanced by the drawn token), and whether every
constrained output parses and validates against the schema.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from zeal.inference import LLM, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 160},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 5},
    },
    "required": ["answer", "confidence", "keywords"],
    "additionalProperties": False,
}
ASKS = ["What is the capital of France?", "Explain photosynthesis briefly.", "Why is the sky blue?",
        "What does a CPU do?", "How do I make a cup of tea?", "Name a good habit for sleeping better.",
        "What is the tallest mountain on Earth?", "What is machine learning?"]


def valid(text: str) -> bool:
    """Whether ``text`` parses and matches :data:`SCHEMA` (checked by hand: no extra dependency)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return False
    kw = obj.get("keywords") if isinstance(obj, dict) else None
    return (isinstance(obj, dict) and set(obj) == {"answer", "confidence", "keywords"}
            and isinstance(obj["answer"], str) and len(obj["answer"]) <= 160
            and isinstance(obj["confidence"], (int, float)) and 0 <= obj["confidence"] <= 1
            and isinstance(kw, list) and len(kw) <= 5 and all(isinstance(k, str) and len(k) <= 24 for k in kw))


def run(llm: LLM, prompts, params: SamplingParams, one_at_a_time: bool) -> tuple[list, float]:
    """Outputs and seconds per generated token."""
    t0 = time.perf_counter()
    outs = [llm.generate([p], params)[0] for p in prompts] if one_at_a_time else llm.generate(prompts, params)
    secs = time.perf_counter() - t0
    return outs, secs / sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    llm = LLM(None, dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32, num_blocks=64)
    ask = "Answer as a JSON object with keys answer, confidence (0 to 1) and keywords (a list of strings). "
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": ask + q}]) for q in ASKS]
    plain = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.tokens, temperature=0.0, structured_outputs={"json": SCHEMA})
    llm.generate(prompts[:2], constrained)  # warm-up (the grammar compiler's first build)
    print(f"SmolLM2-135M-Instruct {args.dtype}, greedy, up to {args.tokens} new tokens, {len(prompts)} chat prompts, "
          f"{torch.get_num_threads()} threads")
    print("| mode | plain ms/token | json_schema ms/token | overhead ms/token | overhead | constrained tokens | "
          "valid JSON |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for one in (True, False):
        _, base = run(llm, prompts, plain, one)
        outs, cons = run(llm, prompts, constrained, one)
        ok = sum(valid(o.outputs[0].text) for o in outs if o.outputs[0].finish_reason == "stop")
        stopped = sum(o.outputs[0].finish_reason == "stop" for o in outs)
        ntok = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"| {'one by one' if one else 'all at once'} | {base * 1e3:.2f} | {cons * 1e3:.2f} | "
              f"{(cons - base) * 1e3:+.2f} | {cons / base - 1:+.0%} | {ntok} | {ok}/{stopped} complete objects |")


if __name__ == "__main__":
    main()
