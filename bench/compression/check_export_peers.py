"""Does what ``zeal compress --format compressed-tensors`` writes load where the issue
says it does? One run, each reader in its own venv:

- vLLM (``--vllm PYTHON``): each folder loaded by vLLM's CPU build, greedy tokens on a
  few prompts beside ``zeal serve``'s (``zeal.LLM`` on the same folder, the same dtype),
  or the exact error where vLLM refuses a scheme;
- llm-compressor / compressed-tensors (``--llmc PYTHON``): each folder read by
  transformers + compressed-tensors with ``dequantize=True`` (their own decompression),
  its linears compared with the weights zeal dequantizes from the same folder.

    flock /tmp/zeal-heavy.lock python bench/compression/check_export_peers.py \\
        --vllm /work/peers/vllm/bin/python --llmc /work/peers/llmc/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from zeal.cli.main import main as zeal_main
from zeal.compression.modules import linear_targets
from zeal.inference.llm import resolve_model_path
from zeal.models.hf import load_hf_model

HERE = Path(__file__).resolve().parent
CASES = {  # folder name: `zeal compress` flags
    "int8": ["--bits", "8"],
    "int4": ["--bits", "4"],
    "int4-g64": ["--bits", "4", "--group-size", "64"],
    "2:4": ["--sparsity", "2:4"],
    "2:4+int8": ["--sparsity", "2:4", "--bits", "8"],
    "2:4+int4-g64": ["--sparsity", "2:4", "--bits", "4", "--group-size", "64"],
}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Python lists are",
           "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"]


def _side(python: str, script: str, job: dict, work: Path, env: dict | None = None, timeout: int = 900) -> dict:
    name = Path(script).stem
    (work / f"{name}.json").write_text(json.dumps(job))
    t0 = time.perf_counter()
    with open(work / f"{name}.log", "w") as log:
        proc = subprocess.run([python, str(HERE / script), str(work / f"{name}.json"), str(work / f"{name}.out.json")],
                              stdout=log, stderr=subprocess.STDOUT, timeout=timeout, cwd=HERE,
                              env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        tail = (work / f"{name}.log").read_text().splitlines()[-8:]
        raise RuntimeError(f"{script} exited {proc.returncode}: " + " | ".join(tail))
    print(f"{script}: {time.perf_counter() - t0:.0f} s", flush=True)
    return json.loads((work / f"{name}.out.json").read_text())


def _zeal_tokens(folder: Path, prompts: list[list[int]], new_tokens: int, dtype: torch.dtype) -> list[list[int]]:
    from zeal.inference import LLM, SamplingParams

    llm = LLM(str(folder), dtype=dtype)
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _weights_vs_zeal(folder: Path, dense_file: str) -> dict:
    ours, _ = load_hf_model(folder)
    theirs = load_file(dense_file)
    worst, equal = 0.0, 0
    targets = linear_targets(ours)
    for k, lin in targets.items():
        w, t = lin.weight.detach(), theirs[f"{k}.weight"]
        equal += int(torch.equal(w, t))
        worst = max(worst, float((w - t).abs().max()))
    return {"linears_equal": f"{equal}/{len(targets)}", "max_abs_diff": worst}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm", default=None, metavar="PYTHON")
    ap.add_argument("--llmc", default=None, metavar="PYTHON")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ", ".join(CASES))
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = ap.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    work = Path(tempfile.mkdtemp(prefix="zeal-ctcheck-"))
    try:
        folders = {}
        for case in cases:
            out = work / case.replace(":", "").replace("+", "_")
            if zeal_main(["compress", *CASES[case], "--seq-len", "64", "--calib-blocks", "2", "--eval-blocks", "2",
                          "--out", str(out)]) != 0:
                raise SystemExit(f"zeal compress {CASES[case]} failed")
            folders[case] = str(out)
        from zeal.inference.llm import load_model_and_tokenizer

        _, tok, _ = load_model_and_tokenizer(resolve_model_path(None))
        prompts = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
        dtype = getattr(torch, args.dtype)
        report = {"cases": {c: {} for c in cases}}
        for case in cases:
            report["cases"][case]["zeal_tokens"] = _zeal_tokens(Path(folders[case]), prompts, args.new_tokens, dtype)
        if args.vllm:
            env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": "auto"}
            res = _side(args.vllm, "_vllm_load_side.py", {"folders": folders, "prompts": prompts,
                                                          "new_tokens": args.new_tokens, "dtype": args.dtype}, work, env)
            report["vllm"] = res["vllm"]
            for case, r in res["runs"].items():
                row = report["cases"][case]
                if "error" in r:
                    row["vllm"] = f"refused: {r['error']}"
                    continue
                ours = row["zeal_tokens"]
                same = sum(a == b for a, b in zip(ours, r["tokens"]))
                firsts = [_first_diff(a, b) for a, b in zip(ours, r["tokens"])]
                row["vllm"] = f"loaded; {same}/{len(ours)} prompts same greedy tokens (first diff at {firsts})"
        if args.llmc:
            res = _side(args.llmc, "_llmc_side.py", {"mode": "load", "folders": folders, "work": str(work)}, work)
            report["llmc"] = res["versions"]
            for case, r in res["runs"].items():
                row = report["cases"][case]
                row["llmc"] = f"refused: {r['error']}" if "error" in r else _weights_vs_zeal(Path(folders[case]),
                                                                                           r["weights"])
        for case in cases:
            row = report["cases"][case]
            print(f"{case:<15} vLLM: {row.get('vllm', '-')}\n{'':<15} llm-compressor loader: {row.get('llmc', '-')}")
        print(json.dumps({"args": vars(args), **{k: v for k, v in report.items() if k != "cases"},
                          "cases": {c: {k: v for k, v in r.items() if k != "zeal_tokens"}
                                    for c, r in report["cases"].items()}}))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
