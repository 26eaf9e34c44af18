"""lm-evaluation-harness against ``zeal serve`` (``local-completions``) beside its ``hf`` backend.

Both score the same local multiple-choice task (built here: counting, letters, days,
months, antonyms, capitals, plurals; a few hundred items, four choices each) with the
same model folder and tokenizer in fp32; the script prints each run's accuracy and wall
time (zeal's includes nothing of the server's start-up) and the per-item difference of
the log-likelihoods lm-eval logged (``--log_samples``).

lm-eval lives in its own virtual environment (it is no dependency of zeal):

    python -m venv /path/lmeval && /path/lmeval/bin/pip install "lm-eval[api]==0.4.13" "torch==2.13.0"
    python bench/inference/bench_lm_eval.py --lm-eval-python /path/lmeval/bin/python [--model FOLDER]

``--prefill-cost N`` instead times the prefill of an N-token prompt in zeal's engine with and
without prompt log-probs (``max_tokens=1``, prefix caching off, best of 3).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
ANTONYMS = [("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("old", "young"),
            ("happy", "sad"), ("light", "dark"), ("open", "closed"), ("early", "late"), ("hard", "soft"),
            ("rich", "poor"), ("strong", "weak"), ("wet", "dry"), ("full", "empty"), ("high", "low"),
            ("long", "short"), ("good", "bad"), ("left", "right"), ("in", "out"), ("true", "false"),
            ("win", "lose"), ("day", "night"), ("black", "white"), ("push", "pull"), ("begin", "end")]
CAPITALS = [("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
            ("Japan", "Tokyo"), ("China", "Beijing"), ("Russia", "Moscow"), ("England", "London"),
            ("Egypt", "Cairo"), ("Greece", "Athens"), ("Portugal", "Lisbon"), ("Austria", "Vienna"),
            ("Ireland", "Dublin"), ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Poland", "Warsaw"),
            ("Canada", "Ottawa"), ("Australia", "Canberra"), ("India", "Delhi"), ("Kenya", "Nairobi"),
            ("Peru", "Lima"), ("Cuba", "Havana"), ("Turkey", "Ankara"), ("Thailand", "Bangkok"),
            ("Finland", "Helsinki"), ("Denmark", "Copenhagen"), ("Belgium", "Brussels"), ("Hungary", "Budapest")]
NOUNS = ["cat", "dog", "car", "tree", "book", "house", "bird", "apple", "chair", "table", "cup", "pen",
         "door", "boat", "hat", "shoe", "ball", "star", "flower", "river", "road", "king", "girl", "boy"]


def _mc(question: str, answer: str, pool: list[str], rng: random.Random) -> dict:
    wrong = rng.sample([p for p in dict.fromkeys(pool) if p != answer], 3)
    choices = [answer, *wrong]
    rng.shuffle(choices)
    return {"question": question, "choices": [" " + c for c in choices], "label": choices.index(answer)}


def build_items(seed: int = 0) -> list[dict]:
    """The task's items (deterministic): each a question, four choices (a leading space) and the label."""
    rng = random.Random(seed)
    items = []
    for n in range(1, 61):  # counting
        items.append(_mc(", ".join(str(n + i) for i in range(4)) + ",", str(n + 4),
                         [str(n + d) for d in (2, 3, 5, 6, 9, 14)], rng))
    for step in (2, 5, 10):
        for n in range(1, 16):
            seq = [str(step * (n + i)) for i in range(4)]
            items.append(_mc(", ".join(seq) + ",", str(step * (n + 4)),
                             [str(step * (n + d)) for d in (2, 3, 5, 7)] + [str(step * (n + 4) + 1)], rng))
    letters = [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    for i in range(22):
        items.append(_mc(", ".join(letters[i : i + 3]) + ",", letters[i + 3], letters, rng))
    for names in (DAYS, MONTHS):
        for i in range(len(names)):
            seq = [names[(i + k) % len(names)] for k in range(3)]
            items.append(_mc(", ".join(seq) + ",", names[(i + 3) % len(names)], names, rng))
    pool = [w for pair in ANTONYMS for w in pair]
    for a, b in ANTONYMS:
        items.append(_mc(f"The opposite of {a} is", b, pool, rng))
    for country, city in CAPITALS:
        items.append(_mc(f"The capital of {country} is", city, [c for _, c in CAPITALS], rng))
    for noun in NOUNS:
        items.append(_mc(f"One {noun}, two", noun + "s", [x + "s" for x in NOUNS], rng))
    return items


TASK_YAML = """task: zeal_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"zeal serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError("zeal serve did not become healthy")


def run_lm_eval(python: str, model: str, model_args: str, task_dir: Path, out: Path, batch: int,
                env: dict) -> float:
    """One lm_eval run; returns its wall time (s)."""
    cmd = [python, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", "zeal_mc",
           "--include_path", str(task_dir), "--batch_size", str(batch), "--log_samples", "--output_path", str(out)]
    t0 = time.monotonic()
    subprocess.run(cmd, check=True, env=env)
    return time.monotonic() - t0


def read_samples(out: Path) -> tuple[dict[int, list[float]], float]:
    """Per item the log-likelihood of each choice, and the accuracy, from an lm_eval output folder."""
    samples = sorted(out.rglob("samples_zeal_mc_*.jsonl"))[-1]
    results = sorted(out.rglob("results_*.json"))[-1]
    lls = {}
    for line in samples.read_text().splitlines():
        s = json.loads(line)
        # each choice's response: [[log-likelihood, is_greedy]] (lm-eval 0.4.13 logs them as strings)
        lls[s["doc_id"]] = [float(r[0][0] if isinstance(r[0], list) else r[0]) for r in s["resps"]]
    acc = json.loads(results.read_text())["results"]["zeal_mc"]["acc,none"]
    return lls, acc


def prefill_cost(model: str, num_tokens: int, threads: int) -> None:
    """Print the prefill time of a ``num_tokens`` prompt with and without ``prompt_logprobs=1``."""
    import torch

    from zeal.inference import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(model, dtype="float32", enable_prefix_caching=False)
    prompt = torch.randint(100, llm.engine.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(0))
    times = {}
    for name, k in (("plain", None), ("prompt_logprobs=1", 1), ("plain", None), ("prompt_logprobs=1", 1)):
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            out = llm.generate([prompt.tolist()], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=k))[0]
            best = min(best, time.perf_counter() - t0)
        assert (out.prompt_logprobs is None) == (k is None)
        times[name] = best  # the second round (warm) is kept
    plain, scored = times["plain"], times["prompt_logprobs=1"]
    print(f"prefill of {num_tokens} tokens ({model}, fp32, {threads} threads, budget "
          f"{llm.engine.config.max_num_batched_tokens}): plain {plain:.3f} s, with prompt log-probs {scored:.3f} s "
          f"({scored / plain:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lm-eval-python", help="python of the virtual environment holding lm-eval")
    ap.add_argument("--model", default=None, help="HF folder (default: zeal's SmolLM2-135M-Instruct folder)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill-cost", type=int, default=0, metavar="N", help="time an N-token prefill instead")
    args = ap.parse_args()
    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root))
    if args.model is None:
        from zeal.models.hf import default_model_path

        args.model = str(default_model_path())
    if args.prefill_cost:
        return prefill_cost(args.model, args.prefill_cost, args.threads)
    if args.lm_eval_python is None:
        ap.error("--lm-eval-python is required (or --prefill-cost N)")
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               OMP_NUM_THREADS=str(args.threads), PYTHONPATH=str(root), TOKENIZERS_PARALLELISM="false")
    items = build_items()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "items.jsonl").write_text("".join(json.dumps(x) + "\n" for x in items))
        (tmp / "task").mkdir()
        (tmp / "task" / "zeal_mc.yaml").write_text(TASK_YAML.format(data=tmp / "items.jsonl"))
        port = _free_port()
        base = f"http://127.0.0.1:{port}"
        serve = subprocess.Popen([sys.executable, "-m", "zeal.cli.main", "serve", args.model, "--dtype", "float32",
                                  "--port", str(port), "--served-model-name", "zeal", "--threads", str(args.threads)],
                                 env=env)
        try:
            _wait_healthy(base, serve)
            margs = (f"model=zeal,base_url={base}/v1/completions,tokenizer={args.model},"
                     "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1")
            t_zeal = run_lm_eval(args.lm_eval_python, "local-completions", margs, tmp / "task", tmp / "zeal",
                                 args.batch_size, env)
        finally:
            serve.terminate()
            serve.wait(60)
        t_hf = run_lm_eval(args.lm_eval_python, "hf", f"pretrained={args.model},dtype=float32", tmp / "task",
                           tmp / "hf", args.batch_size, env | {"CUDA_VISIBLE_DEVICES": ""})
        zl, zacc = read_samples(tmp / "zeal")
        hl, hacc = read_samples(tmp / "hf")
    diffs = [abs(a - b) for d in hl for a, b in zip(zl[d], hl[d])]
    same_pick = sum(max(range(len(hl[d])), key=hl[d].__getitem__) == max(range(len(zl[d])), key=zl[d].__getitem__)
                    for d in hl)
    print(f"items: {len(hl)} ({len(diffs)} choices), model {args.model}, fp32, batch {args.batch_size}, "
          f"{args.threads} threads")
    print(f"accuracy: zeal (local-completions) {zacc:.4f}   hf {hacc:.4f}   same choice picked: {same_pick}/{len(hl)}")
    print(f"per-choice log-likelihood |zeal - hf|: max {max(diffs):.2e}  mean {sum(diffs) / len(diffs):.2e}")
    print(f"lm_eval wall time: zeal {t_zeal:.1f} s (server already up)   hf {t_hf:.1f} s")


if __name__ == "__main__":
    main()
