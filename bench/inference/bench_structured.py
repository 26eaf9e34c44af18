"""Structured outputs: the cost per token of a ``json_schema`` constraint.

    flock /tmp/zeal-heavy.lock python bench/inference/bench_structured.py [--dtype bf16] [--tokens 64]

SmolLM2-135M-Instruct (the embedded model), greedy, chat prompts that ask for a JSON
answer. Each prompt runs with ``structured_outputs={"json": SCHEMA}`` (what
``response_format`` ``json_schema`` becomes; it stops when the object is complete) and then
without a constraint for exactly as many tokens as its constrained answer took
(``ignore_eos``) — the same prefill and the same number of decode steps, so the difference
per token is the constraint's own cost (an unconstrained run of a fixed length would
spread the prompt's prefill over more tokens and overstate it). One request at a time
and all at once. Also timed directly: the time spent in the grammar work of the
constrained runs (llguidance's mask of the next token, applying it to the logits,
advancing the matcher). Printed: ms per generated token of each, their difference, and
whether every constrained output parses and validates against the schema.
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


def run(llm: LLM, prompts, params, one_at_a_time: bool) -> tuple[list, float]:
    """Outputs and seconds per generated token (``params``: one per prompt)."""
    t0 = time.perf_counter()
    if one_at_a_time:
        outs = [llm.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    else:
        outs = llm.generate(prompts, params)
    secs = time.perf_counter() - t0
    return outs, secs / sum(len(o.outputs[0].token_ids) for o in outs)


class GrammarTimer:
    """Seconds spent in the engine's grammar work: masking the logits (the mask computed
    by llguidance and applied) and advancing the matchers."""

    def __init__(self) -> None:
        import zeal.inference.engine as eng

        self.seconds, self._eng = 0.0, eng
        self._mask = eng.mask_rows
        eng.mask_rows = self._timed(self._mask)

    def _timed(self, fn):
        def wrapped(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t
        return wrapped

    def matcher_hook(self, llm: LLM) -> None:
        """Time each matcher's ``consume_token`` too (wrapped when a request is added)."""
        engine = llm.engine
        add = engine.add_request

        def add_request(*a, **k):
            out = add(*a, **k)
            for req in engine.requests.values():
                for seq in req.seqs:
                    m = seq.matcher
                    if m is not None and not isinstance(m, _TimedMatcher):
                        seq.matcher = _TimedMatcher(m, self)
            return out
        engine.add_request = add_request


class _TimedMatcher:
    def __init__(self, m, timer: GrammarTimer) -> None:
        self._m, self._timer = m, timer

    def consume_token(self, *a, **k):
        t = time.perf_counter()
        try:
            return self._m.consume_token(*a, **k)
        finally:
            self._timer.seconds += time.perf_counter() - t

    def __getattr__(self, name):
        return getattr(self._m, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    llm = LLM(None, dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32, num_blocks=64)
    ask = "Answer as a JSON object with keys answer, confidence (0 to 1) and keywords (a list of strings). "
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": ask + q}]) for q in ASKS]
    constrained = SamplingParams(max_tokens=args.tokens, temperature=0.0, structured_outputs={"json": SCHEMA})
    llm.generate(prompts[:2], constrained)  # warm-up (the grammar compiler's first build)
    timer = GrammarTimer()
    timer.matcher_hook(llm)
    print(f"SmolLM2-135M-Instruct {args.dtype}, greedy, up to {args.tokens} new tokens, {len(prompts)} chat prompts, "
          f"{torch.get_num_threads()} threads; plain runs as many tokens per prompt as its constrained answer")
    print("| mode | plain ms/token | json_schema ms/token | overhead ms/token | overhead | grammar work ms/token | "
          "tokens | valid JSON |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for one in (True, False):
        timer.seconds = 0.0
        outs, cons = run(llm, prompts, [constrained] * len(prompts), one)
        grammar = timer.seconds
        lens = [len(o.outputs[0].token_ids) for o in outs]
        plain = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lens]
        _, base = run(llm, prompts, plain, one)
        ok = sum(valid(o.outputs[0].text) for o in outs if o.outputs[0].finish_reason == "stop")
        stopped = sum(o.outputs[0].finish_reason == "stop" for o in outs)
        print(f"| {'one by one' if one else 'all at once'} | {base * 1e3:.2f} | {cons * 1e3:.2f} | "
              f"{(cons - base) * 1e3:+.2f} | {cons / base - 1:+.0%} | {grammar / sum(lens) * 1e3:.3f} | "
              f"{sum(lens)} | {ok}/{stopped} complete objects |")

if __name__ == "__main__":
    main()
