"""Does what ``zeal compress --format compressed-tensors`` writes load where the issue
says it does? One run, each reader in its own venv:

- vLLM (``--vllm PYTHON``): each folder loaded by vLLM's CPU build; the held-out
  perplexity from vLLM's prompt logprobs beside zeal's on the same folder (fp32, and
  bf16 for the rounding floor), the mean |Δ log p| per token, and the greedy tokens on a
  few prompts beside ``zeal serve``'s (same dtype); or the exact error where vLLM
  refuses a scheme;
- llm-compressor / compressed-tensors (``--llmc PYTHON``): each folder read by
  transformers + compressed-tensors with ``dequantize=True`` (their own decompression),
  its linears compared with the weights zeal dequantizes from the same folder; and, as
  controls, llm-compressor's own RTN W8A16 / W4A16 folders of the same model given to
  vLLM and to ``zeal serve`` too (a scheme vLLM refuses for both is vLLM's limit).

bf16 by default: vLLM's CPU int4 kernel has no fp32 path ("cpu_gemm_wna16" not
implemented for 'Float').

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
from safetensors.torch import load_file, save_file

from zeal.cli.main import main as zeal_main
from zeal.compression.calibration import blocks, split_text
from zeal.compression.export import decompress_state
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


@torch.no_grad()
def _zeal_logprobs(folder: Path, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """log p(x_t | x_<t) under zeal's model of ``folder`` (weights dequantized on load)."""
    model, _ = load_hf_model(folder, dtype, state_transform=decompress_state)
    lg = model.eval()(x)
    lg = (lg.logits if hasattr(lg, "logits") else lg)[:, :-1].float()
    return torch.log_softmax(lg, -1).gather(-1, x[:, 1:, None]).squeeze(-1)


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _weights_vs_zeal(folder: Path, dense_file: str) -> dict:
    ours, _ = load_hf_model(folder, state_transform=decompress_state)
    theirs = load_file(dense_file)
    worst, equal = 0.0, 0
    targets = linear_targets(ours)
    for k, lin in targets.items():
        w, t = lin.weight.detach(), theirs[f"{k}.weight"]
        equal += int(torch.equal(w, t))
        worst = max(worst, float((w - t).abs().max()))
    return {"linears_equal": f"{equal}/{len(targets)}", "max_abs_diff": worst}


def _zeal_folders(cases: list[str], work: Path) -> dict[str, str]:
    folders = {}
    for case in cases:
        out = work / case.replace(":", "").replace("+", "_")
        if zeal_main(["compress", *CASES[case], "--seq-len", "64", "--calib-blocks", "2", "--eval-blocks", "2",
                      "--out", str(out)]) != 0:
            raise SystemExit(f"zeal compress {CASES[case]} failed")
        folders[case] = str(out)
    return folders


def _llmc(python: str, folders: dict, controls: list[str], src: Path, tok, work: Path) -> tuple[dict, dict]:
    """compressed-tensors' loader on zeal's folders; llm-compressor's own folders for
    ``controls`` (RTN, kept on disk for the other readers)."""
    import zeal.compression.calibration as calibration

    ctext, etext = split_text(None)
    save_file({"calib": blocks(tok.encode(ctext, add_special_tokens=False), 64, 2),
               "evals": blocks(tok.encode(etext, add_special_tokens=False), 64, 2)}, str(work / "data.safetensors"))
    job = {"folders": folders, "work": str(work), "runs": controls, "keep_saved": True, "model": str(src),
           "data": str(work / "data.safetensors"), "calibration_py": calibration.__file__}
    res = _side(python, "_llmc_side.py", job, work)
    rows = {case: (f"refused: {r['error']}" if "error" in r else _weights_vs_zeal(Path(folders[case]), r["weights"]))
            for case, r in res["loads"].items()}
    made = {f"llm-compressor {run}": r["saved"] for run, r in res["runs"].items() if "saved" in r}
    for run, r in res["runs"].items():
        if "error" in r:
            print(f"llm-compressor control {run!r} failed: {r['error']}")
    return {"versions": res["versions"], "rows": rows}, made


def _vllm_rows(res: dict, report: dict, folders: dict, scored: torch.Tensor) -> None:
    """Held-out perplexity by vLLM's prompt logprobs beside zeal's (fp32 and bf16) on the
    same folder, the mean |Δ log p| per token, and the greedy tokens."""
    for case, r in res["runs"].items():
        row = report["cases"][case]
        if "error" in r:
            row["vllm"] = f"refused: {r['error']}"
            continue
        theirs = torch.tensor(r["logprobs"])
        try:
            fp32, bf16 = (_zeal_logprobs(Path(folders[case]), scored, d) for d in (torch.float32, torch.bfloat16))
        except Exception as e:
            row["vllm"] = f"loaded; ppl {float(torch.exp(-theirs.mean())):.3f} (zeal cannot read it: {e})"
            continue
        ppl = {k: round(float(torch.exp(-v.mean())), 3) for k, v in (("vllm", theirs), ("zeal_fp32", fp32),
                                                                      ("zeal_bf16", bf16))}
        row["ppl"] = ppl
        row["mean_abs_dlogp"] = {"vllm_vs_zeal_fp32": round(float((theirs - fp32).abs().mean()), 4),
                                 "zeal_bf16_vs_fp32": round(float((bf16 - fp32).abs().mean()), 4)}
        ours = row["zeal_tokens"] if isinstance(row.get("zeal_tokens"), list) else []
        firsts = [_first_diff(a, b) for a, b in zip(ours, r["tokens"])]
        row["vllm"] = (f"loaded; held-out ppl {ppl}; mean |dlogp| {row['mean_abs_dlogp']}; greedy: "
                       f"{sum(a == b for a, b in zip(ours, r['tokens']))}/{len(ours)} same (first diff at {firsts})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm", default=None, metavar="PYTHON")
    ap.add_argument("--llmc", default=None, metavar="PYTHON")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ", ".join(CASES))
    ap.add_argument("--controls", default="rtn w8a16 ch,rtn w4a16 g64",
                    help="llm-compressor folders also given to vLLM and zeal (needs --llmc; '' for none)")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--score-blocks", type=int, default=4, help="held-out 128-token blocks scored by both")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    args = ap.parse_args()
    from zeal.inference.llm import load_model_and_tokenizer

    cases = [c for c in args.cases.split(",") if c]
    work = Path(tempfile.mkdtemp(prefix="zeal-ctcheck-"))
    try:
        folders = _zeal_folders(cases, work)
        src = resolve_model_path(None)
        _, tok, _ = load_model_and_tokenizer(src)
        prompts = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
        scored = blocks(tok.encode(split_text(None)[1], add_special_tokens=False), 128, args.score_blocks)
        report = {"cases": {c: {} for c in cases}}
        if args.llmc:
            controls = [c for c in args.controls.split(",") if c]
            llmc, made = _llmc(args.llmc, folders, controls, src, tok, work)
            report["llmc"] = llmc["versions"]
            for case, row in llmc["rows"].items():
                report["cases"][case]["llmc"] = row
            folders.update(made)
            report["cases"].update({name: {} for name in made})
        for case, folder in folders.items():
            try:  # zeal serve on the folder (an llm-compressor control too)
                toks = _zeal_tokens(Path(folder), prompts, args.new_tokens, getattr(torch, args.dtype))
            except Exception as e:
                toks = f"zeal refused: {type(e).__name__}: {e}"
            report["cases"][case]["zeal_tokens"] = toks
        if args.vllm:
            env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": "auto"}
            job = {"folders": folders, "prompts": prompts, "new_tokens": args.new_tokens, "dtype": args.dtype,
                   "score": scored.tolist()}
            res = _side(args.vllm, "_vllm_load_side.py", job, work, env)
            report["vllm"] = res["vllm"]
            _vllm_rows(res, report, folders, scored)
        for case, row in report["cases"].items():
            zeal = row["zeal_tokens"] if isinstance(row["zeal_tokens"], str) else "served"
            print(f"{case:<30} zeal: {zeal}\n{'':<30} vLLM: {row.get('vllm', '-')}\n"
                  f"{'':<30} compressed-tensors loader: {row.get('llmc', '-')}")
        print(json.dumps({"args": vars(args), **{k: v for k, v in report.items() if k != "cases"},
                          "cases": {c: {k: v for k, v in r.items() if k != "zeal_tokens"}
                                    for c, r in report["cases"].items()}}))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
