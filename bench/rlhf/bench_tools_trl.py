"""Multi-turn GRPO with a calculator tool, zeal beside TRL 1.16's ``GRPOTrainer(tools=...)``,
on SmolLM2-135M-Instruct (the embedded model) and the built-in arithmetic questions.

SmolLM2's own chat template renders no tools, and TRL refuses a tokenizer whose template
cannot render a tool-calling conversation or whose tool-call format it cannot parse. Both
sides therefore get, at run time, TRL's ChatML tool template for Qwen2.5 (read from TRL's
installation, ``trl/chat_templates/qwen2_5.jinja``; SmolLM2 has the same ``<|im_start|>`` /
``<|im_end|>`` tokens): tools listed in the system turn, calls written as
``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, which zeal's tool-call parser
reads as well. A bench-side setting: zeal's code is unchanged (its ``ToolEnv`` with its
calculator, ``zeal/rlhf/tools.py``; TRL calls the same function). Same prompts in the same
order (a system line, then the question), seed, reward (the task's graded reward on the
final assistant message), β, lr, G, episode budget (``--tokens``, tool outputs included) and
turns. Per side and step: mean reward, exact accuracy (the right first integer), tool calls
per episode, seconds; the rendered prompts of both sides are compared.

    PYTHONPATH=. python bench/rlhf/bench_tools_trl.py --steps 8 --seed 0
"""

from __future__ import annotations

import argparse
import glob
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parents[2]
SYSTEM = "You are a helpful assistant. You can use a calculator."
# the calculator's spec as TRL derives it from the tool function's signature and docstring (same text both sides)
SPEC = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression (+, -, *, /, //, %, **, parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string",
                                                                   "description": "the arithmetic expression"}},
                   "required": ["expression"]}, "return": {"type": "string"}}}


def trl_template(trl_python: str) -> str:
    """TRL's Qwen2.5 tool chat template, from TRL's own installation."""
    venv = Path(trl_python).absolute().parents[1]  # the venv (its python is a link out of it)
    hits = glob.glob(str(venv / "lib" / "python3*" / "site-packages" / "trl" / "chat_templates" / "qwen2_5.jinja"))
    if not hits:
        raise SystemExit(f"no trl/chat_templates/qwen2_5.jinja under {venv}")
    return Path(hits[0]).read_text()


def rows_and_order(args) -> tuple[list[dict], list[int]]:
    """The chat rows, and the indices zeal's ``grpo`` draws step by step (its seeded generator)."""
    import torch

    from zeal.rlhf.tasks import arithmetic_rows

    rows = [{"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": r["prompt"]}],
             "answer": r["answer"]} for r in arithmetic_rows(64, args.seed)]
    gen = torch.Generator().manual_seed(args.seed * 1000003)
    order = [i for _ in range(args.steps) for i in torch.randint(len(rows), (args.prompts,), generator=gen).tolist()]
    return rows, order


def run_zeal(args, template: str, rows: list[dict], first: int) -> dict:
    from zeal.inference.tokenizer import Tokenizer
    from zeal.models.hf import default_model_path
    from zeal.rlhf import grpo, tasks
    from zeal.rlhf.multiturn import ToolEnv
    from zeal.rlhf.tools import calculator

    tok = Tokenizer.from_folder(default_model_path())
    tok.chat_template = template
    accuracy: list[float] = []

    def reward(prompts, completions, **_):
        exact = tasks.arithmetic_reward(prompts, completions)
        accuracy.append(sum(x > 0 for x in exact) / len(exact))
        return getattr(tasks, args.reward)(prompts, completions)

    def environment(row):
        return ToolEnv(tok, row, {"calculator": calculator}, [SPEC])

    rc = {"steps": args.steps, "batch_size": args.prompts, "num_generations": args.n, "max_new_tokens": args.tokens,
          "max_episode_tokens": args.tokens, "max_turns": args.turns, "beta": args.beta, "seed": args.seed,
          "loss_type": "grpo", "log_every": 1}
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}}, "rlhf": rc}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="zeal-bench-tools-trl-") as out:  # SmolLM2 checkpoints: not kept
        res = grpo(None, reward, rows, cfg, tokenizer=tok, out=out, environment=environment)
    wall = time.perf_counter() - t0
    m = res.metrics
    steps = [r["time_generate_s"] + r["time_train_s"] + r["time_sync_s"] for r in m]
    return {"rewards": [r["reward"] for r in m], "accuracy": accuracy, "tool_calls": [r.get("tool_calls", 0.0) for r in m],
            "step_s": steps, "wall_s": wall,
            "first_prompt": tok.render_chat(rows[first]["prompt"], tools=[SPEC])}  # TRL renders its first row


def run_trl(args, template: str, rows: list[dict], order: list[int]) -> dict:
    from bench_trl import trl_side

    from zeal.models.hf import default_model_path

    spec = {"job": "grpo_tools", "model": str(default_model_path()), "rows": [rows[i] for i in order],
            "chat_template": template, "steps": args.steps, "batch_size": args.prompts, "num_generations": args.n,
            "max_completion_length": args.tokens, "max_turns": args.turns, "beta": args.beta, "lr": args.lr,
            "optimizer": "AdamW", "grad_clip": 1.0, "seed": args.seed, "zeal_root": str(ROOT), "reward": args.reward,
            "progress": tempfile.mktemp(suffix=".json")}
    try:
        return trl_side(args.trl_python, spec, args.timeout)
    except (RuntimeError, subprocess.TimeoutExpired) as e:  # keep the steps TRL finished
        print(f"TRL side stopped: {str(e)[-1500:]}", file=sys.stderr)
        part = Path(spec["progress"])
        done = json.loads(part.read_text()) if part.exists() else {}
        return {"rewards": [], "accuracy": [], "tool_calls": [], "step_s": [], **done, "first_prompt": "",
                "stopped": True}


def _mean(xs) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def report(z: dict, t: dict, args) -> None:
    same = z["first_prompt"] == t["first_prompt"]
    print(f"rendered prompts identical on both sides: {same}")
    if not same:
        print(f"zeal: {z['first_prompt']!r}\nTRL:  {t['first_prompt']!r}")
    print(f"{'step':>4} {'zeal reward':>11} {'acc':>5} {'calls':>5} {'s':>6} | {'TRL reward':>10} {'acc':>5} "
          f"{'calls':>5} {'s':>6}")

    def cell(d: dict, k: str, f: str, i: int) -> str:
        return format(d[k][i], f) if i < len(d[k]) else "-"

    for i in range(args.steps):
        print(f"{i + 1:>4} {cell(z, 'rewards', '11.3f', i)} {cell(z, 'accuracy', '5.2f', i)} {cell(z, 'tool_calls', '5.2f', i)} "
              f"{cell(z, 'step_s', '6.1f', i)} | {cell(t, 'rewards', '10.3f', i)} {cell(t, 'accuracy', '5.2f', i)} "
              f"{cell(t, 'tool_calls', '5.2f', i)} {cell(t, 'step_s', '6.1f', i)}")
    h = max(args.steps // 2, 1)
    for name, d in (("zeal", z), ("TRL", t)):
        print(f"{name}: reward first {h} steps {_mean(d['rewards'][:h]):.3f}, last {h} {_mean(d['rewards'][-h:]):.3f}; "
              f"exact accuracy {_mean(d['accuracy'][:h]):.3f} -> {_mean(d['accuracy'][-h:]):.3f}; tool calls per "
              f"episode {_mean(d['tool_calls']):.2f}; s/step (steps 2..) {_mean(d['step_s'][1:]):.1f}")
    if t.get("completions"):
        print("a TRL episode:", t["completions"][0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--n", type=int, default=4, help="episodes per prompt (G)")
    ap.add_argument("--tokens", type=int, default=64, help="answer tokens of an episode, tool outputs included")
    ap.add_argument("--turns", type=int, default=2, help="policy turns per episode (TRL: tool iterations + 1)")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reward", default="graded_arithmetic_reward", choices=["graded_arithmetic_reward",
                                                                             "arithmetic_reward"])
    ap.add_argument("--trl-python", default="/work/peers/trl/bin/python")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", help="also write both sides' figures to this file")
    ap.add_argument("--sides", default="zeal,trl")
    ap.add_argument("--zeal-json", help="zeal's side from an earlier run's --json file instead of running it")
    args = ap.parse_args()
    template = trl_template(args.trl_python)
    rows, order = rows_and_order(args)
    sides = args.sides.split(",")
    z = run_zeal(args, template, rows, order[0]) if "zeal" in sides else None
    if args.zeal_json:
        z = json.loads(Path(args.zeal_json).read_text())["zeal"]
    if z is not None:
        print(json.dumps({"zeal": {k: v for k, v in z.items() if k != "first_prompt"}}), flush=True)
    t = run_trl(args, template, rows, order) if "trl" in sides else None
    if t is not None:
        print(json.dumps({"trl": {k: v for k, v in t.items() if k != "first_prompt"}}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"zeal": z, "trl": t}))
    if z is not None and t is not None:
        report(z, t, args)


if __name__ == "__main__":
    main()
