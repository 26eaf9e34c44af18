"""The built-in offline task of the default jobs: short arithmetic with a checkable answer.

``"What is 3 + 4? Reply with the number only."`` — the reward is 1 when the first integer
of the answer is the right one (plus 0.1 when the answer is nothing but that number),
SFT conversations answer right, and preference pairs put a right answer before a wrong one.
:func:`graded_arithmetic_reward` grades the same questions with partial credit (a small
model's first answers already earn a varying, non-zero reward: ``--reward
zeal.rlhf.tasks:graded_arithmetic_reward``).

:func:`calculator_task` is a toy multi-turn task for the calculator tool: a word-level
vocabulary in which each tool call is one token, so that a 2-layer model learns within a
short run to call the tool (tests and ``bench/rlhf/bench_tools.py``).
"""

from __future__ import annotations

import re

import torch

QUESTION = "What is {a} {op} {b}? Reply with the number only."
_Q = re.compile(r"What is (-?\d+) ([+\-*]) (-?\d+)\?")
_INT = re.compile(r"-?\d+")


def _solve(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def arithmetic_rows(n: int, seed: int = 0) -> list[dict]:
    """``n`` rows ``{"prompt", "answer", "messages", "chosen", "rejected"}`` (every job's keys)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        a, b = (int(x) for x in torch.randint(1, 10, (2,), generator=g))
        op = "+-*"[int(torch.randint(3, (1,), generator=g))]
        ans = _solve(a, op, b)
        wrong = ans + int(torch.randint(1, 4, (1,), generator=g)) * (1 if int(torch.randint(2, (1,), generator=g))
                                                                    else -1)
        q = QUESTION.format(a=a, op=op, b=b)
        rows.append({"prompt": q, "answer": ans, "chosen": str(ans), "rejected": str(wrong),
                     "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": str(ans)}]})
    return rows


def expected_answer(prompt) -> int | None:
    """The answer of a built-in question (None for any other prompt)."""
    text = prompt if isinstance(prompt, str) else prompt.get("prompt", "") if isinstance(prompt, dict) else ""
    m = _Q.search(text)
    return _solve(int(m.group(1)), m.group(2), int(m.group(3))) if m else None


def arithmetic_reward(prompts, completions, **_) -> list[float]:
    """1 for a right first integer (+0.1 when the answer is only the number), else 0; a row
    given as a dict may carry its own ``answer``."""
    out = []
    for p, c in zip(prompts, completions):
        want = p.get("answer") if isinstance(p, dict) and "answer" in p else expected_answer(p)
        got = _INT.search(c or "")
        ok = want is not None and got is not None and int(got.group()) == int(want)
        out.append((1.0 + 0.1 * (c.strip() == got.group())) if ok else 0.0)
    return out


def graded_arithmetic_reward(prompts, completions, **_) -> list[float]:
    """Partial credit in [0, 1] for the built-in questions, so that a small model's first
    answers already score above 0 and differ: 0.1 when the answer holds an integer, 0.2
    when the right number is among its integers, 0.4 / (1 + |first integer − answer|)
    (closeness of the first integer), and 0.3 when the answer is nothing but the right
    number; prompts as for :func:`arithmetic_reward`."""
    out = []
    for p, c in zip(prompts, completions):
        want = p.get("answer") if isinstance(p, dict) and "answer" in p else expected_answer(p)
        got = [int(x) for x in _INT.findall(c or "")]
        if want is None or not got:
            out.append(0.0)
            continue
        want = int(want)
        r = 0.1 + 0.2 * (want in got) + 0.4 / (1 + abs(got[0] - want)) + 0.3 * ((c or "").strip() == str(want))
        out.append(round(r, 6))
    return out


CALC_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} <eos> {% endfor %}"
                 "{% if add_generation_prompt %}assistant : {% endif %}")
CALC_EXPRESSIONS = ("2+3", "4*2", "9-5", "3+3")


def calculator_call(expression: str) -> str:
    """A calculator call as one whitespace-free word (one token of :func:`calculator_task`'s vocabulary)."""
    import json

    return ("<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": expression}},
                                       separators=(",", ":")) + "</tool_call>")


def calculator_task(expressions=CALC_EXPRESSIONS):
    """``(tokenizer, rows, vocabulary size)`` of the toy calculator task: rows
    ``{"prompt": "What is 2+3 ?", "answer": 5}``; zeal's tokenizer over a word-level
    vocabulary (roles, the numbers 0-20, the expressions and one call word per expression;
    end token ``<eos>`` = id 1) with a chat template that renders tool messages."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    from zeal.inference.tokenizer import Tokenizer
    from zeal.rlhf.tools import safe_eval

    words = ["[UNK]", "<eos>", "user", "assistant", "tool", "system", ":", "What", "is", "?", "error:"]
    words += [str(i) for i in range(0, 21)] + list(expressions) + [calculator_call(e) for e in expressions]
    hf = HFTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    hf.pre_tokenizer = WhitespaceSplit()
    hf.add_special_tokens([AddedToken("<eos>", special=True)])
    tok = Tokenizer(hf, {"eos_token": "<eos>", "chat_template": CALC_TEMPLATE})
    rows = [{"prompt": f"What is {e} ?", "answer": safe_eval(e)} for e in expressions]
    return tok, rows, len(words)
