"""zeal's one-shot compression beside llm-compressor's and torchao's, in one run, on the
same model (SmolLM2-135M-Instruct, the HF folder zeal makes from the embedded GGUF, fp32),
the same calibration blocks and the same held-out blocks as ``bench_compression.py``.

Each peer runs in its own venv (``--llmc PYTHON``, ``--torchao PYTHON``; a side script,
JSON job in, JSON result out, token blocks and weights as safetensors). Every row's
perplexity is taken by the same function (``zeal.compression.calibration.perplexity``)
on zeal's model with the row's linears loaded as dense fp32 weights (a peer's weights
dequantized by the peer's own code); ``own`` is the perplexity through the peer's own
forward (HF model + its quantized tensors) where it runs on this CPU. Bytes: the
``*.safetensors`` of the folder written (zeal's compressed-tensors export, llm-compressor's
``save_compressed``) or, for torchao (no folder format), its tensors' storage.

    flock /tmp/zeal-heavy.lock python bench/compression/bench_peers.py \\
        --llmc /work/peers/llmc/bin/python --torchao /work/peers/torchao/bin/python
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import zeal.compression.calibration as calibration
from zeal.cli.compress import write_folder
from zeal.compression.admm_layerwise import reconstruction_admm
from zeal.compression.calibration import blocks, perplexity, split_text
from zeal.compression.modules import (
    QuantSpec,
    apply_masks_,
    collect_input_norms,
    linear_targets,
    magnitude_masks,
    ptq_,
    wanda_masks,
)
from zeal.compression.pipeline import CompressJob
from zeal.inference.llm import load_model_and_tokenizer, resolve_model_path

HERE = Path(__file__).resolve().parent
ZEAL_RUNS = {  # name: (n, m, method, bits, group_size)
    "2:4 magnitude": (2, 4, "magnitude", None, None),
    "2:4 wanda": (2, 4, "wanda", None, None),
    "2:4 admm": (2, 4, "admm", None, None),  # ADMM on each linear's output reconstruction
    "int8 per-channel": (None, 4, "magnitude", 8, None),
    "int4 per-channel": (None, 4, "magnitude", 4, None),
    "int4 g64": (None, 4, "magnitude", 4, 64),
}
# peer run -> the zeal row it is set beside
LLMC_RUNS = {"sparsegpt 2:4": "2:4 admm", "wanda 2:4": "2:4 wanda", "rtn w8a16 ch": "int8 per-channel",
             "gptq w8a16 ch": "int8 per-channel", "rtn w4a16 g64": "int4 g64", "gptq w4a16 g64": "int4 g64"}
TORCHAO_RUNS = {"2:4 semi-structured": "2:4 magnitude", "2:4 magnitude (fake sparsity)": "2:4 magnitude",
                "2:4 wanda": "2:4 wanda", "int8 weight-only": "int8 per-channel",
                "int4 weight-only g64": "int4 g64", "intx int4 g64": "int4 g64"}


def _zeal_run(base, calib, spec: tuple) -> tuple[torch.nn.Module, float, dict]:
    """One-shot pruning / PTQ of a copy of ``base`` with zeal's own functions; the time."""
    n, m, method, bits, gs = spec
    model = copy.deepcopy(base)
    t0 = time.perf_counter()
    targets = linear_targets(model)
    masks = {}
    if n is not None:
        if method == "wanda":
            norms = collect_input_norms(model, targets, lambda: perplexity(model, calib))
            masks = wanda_masks(targets, n, m, norms)
        elif method == "admm":
            masks, _ = reconstruction_admm(targets, lambda: perplexity(model, calib), n, m, log=lambda _: None)
        else:
            masks = magnitude_masks(targets, n, m)
        apply_masks_(model, masks)
    if bits is not None:
        ptq_(targets, QuantSpec(bits, gs))
    return model, time.perf_counter() - t0, masks


def _export_bytes(model, src: Path, out: Path, spec: tuple) -> int:
    n, m, method, bits, gs = spec
    write_folder(model, src, out, list(linear_targets(model)), CompressJob(n, m, method, bits, gs), "compressed-tensors")
    nbytes = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    shutil.rmtree(out)
    return nbytes


def _load_linears(base, path: str) -> torch.nn.Module:
    """A copy of ``base`` with every target linear's weight from a peer's dense file."""
    sd = load_file(path)
    model = copy.deepcopy(base)
    params = dict(model.named_parameters())
    missing = [f"{k}.weight" for k in linear_targets(model) if f"{k}.weight" not in sd]
    if missing:
        raise ValueError(f"{path}: no weight for {len(missing)} linears, e.g. {missing[0]}")
    with torch.no_grad():
        for k, v in sd.items():
            params[k].copy_(v)
    return model


def _sparsity_facts(model, masks: dict | None) -> dict:
    """Whether every group of 4 holds at most 2 nonzeros, and how many zeros agree with
    zeal's mask of the same method."""
    ok, agree, total = True, 0, 0
    for k, lin in linear_targets(model).items():
        w = lin.weight.detach()
        ok &= bool(((w.reshape(-1, 4) != 0).sum(1) <= 2).all())
        if masks:
            agree += int(((w != 0) == masks[f"{k}.weight"].bool()).sum())
            total += w.numel()
    return {"all_2of4": ok, **({"mask_agreement": round(agree / total, 4)} if total else {})}


def _side(python: str, script: str, job: dict, work: Path, timeout: int) -> dict:
    name = Path(script).stem
    (work / f"{name}.json").write_text(json.dumps(job))
    with open(work / f"{name}.log", "w") as log:
        try:
            proc = subprocess.run([python, str(HERE / script), str(work / f"{name}.json"),
                                   str(work / f"{name}.out.json")], stdout=log, stderr=subprocess.STDOUT,
                                  timeout=timeout, cwd=HERE)
        except subprocess.TimeoutExpired:  # the runs it finished are in its result file
            print(f"{script}: timed out after {timeout} s; keeping the runs it finished", flush=True)
            proc = None
    if proc is None and (work / f"{name}.out.json").exists():
        return json.loads((work / f"{name}.out.json").read_text())
    if proc is None or proc.returncode != 0:
        tail = (work / f"{name}.log").read_text().splitlines()[-5:]
        raise RuntimeError(f"{script} exited {proc.returncode}: " + " | ".join(tail))
    return json.loads((work / f"{name}.out.json").read_text())


def _row(tool, run, res, zeal_row, base, evals, zeal_masks) -> dict:
    row = {"tool": tool, "run": run, "beside": zeal_row}
    if "error" in res:
        return {**row, "error": res["error"]}
    model = _load_linears(base, res["weights"])
    row.update(ppl=perplexity(model, evals), own_ppl=res.get("own_ppl"), seconds=res["seconds"], bytes=res["bytes"])
    if "2:4" in run:
        row.update(_sparsity_facts(model, zeal_masks.get(zeal_row)))
    Path(res["weights"]).unlink(missing_ok=True)
    return row


def _print(rows: list[dict], dense_ppl: float, dense_bytes: int) -> None:
    zeal = {r["run"]: r for r in rows if r["tool"] == "zeal"}
    print(f"\n{'tool':<15}{'run':<31}{'ppl':>9}{'own':>9}{'x zeal':>8}{'MB':>8}{'x zeal':>8}{'s':>7}{'x zeal':>8}  notes")
    print(f"{'(dense)':<15}{'':<31}{dense_ppl:9.2f}{'':>9}{'':>8}{dense_bytes / 1e6:8.1f}")
    for r in rows:
        if "error" in r:
            print(f"{r['tool']:<15}{r['run']:<31}  fails here: {r['error']}")
            continue
        z = zeal.get(r["beside"], r)
        own = f"{r['own_ppl']:9.2f}" if r.get("own_ppl") else f"{'':>9}"
        notes = " ".join(f"{k}={r[k]}" for k in ("all_2of4", "mask_agreement") if k in r)
        if r["tool"] != "zeal":
            notes = f"vs zeal {r['beside']}; {notes}"
        print(f"{r['tool']:<15}{r['run']:<31}{r['ppl']:9.2f}{own}{r['ppl'] / z['ppl']:8.2f}{r['bytes'] / 1e6:8.1f}"
              f"{r['bytes'] / z['bytes']:8.2f}{r['seconds']:7.1f}{r['seconds'] / max(z['seconds'], 1e-9):8.1f}  {notes}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--calib-blocks", type=int, default=8)
    ap.add_argument("--eval-blocks", type=int, default=8)
    ap.add_argument("--llmc", default=None, metavar="PYTHON", help="llm-compressor venv's python (omit: skipped)")
    ap.add_argument("--torchao", default=None, metavar="PYTHON", help="torchao venv's python (omit: skipped)")
    ap.add_argument("--llmc-runs", default=",".join(LLMC_RUNS), help="comma-separated subset of " + ", ".join(LLMC_RUNS))
    ap.add_argument("--torchao-runs", default=",".join(TORCHAO_RUNS), help="subset of " + ", ".join(TORCHAO_RUNS))
    ap.add_argument("--peer-timeout", type=int, default=600)
    args = ap.parse_args()
    threads = torch.get_num_threads()
    src = resolve_model_path(None)
    base, tok, _ = load_model_and_tokenizer(src, torch.float32)
    ctext, etext = split_text(None)
    calib = blocks(tok.encode(ctext, add_special_tokens=False), args.seq_len, args.calib_blocks)
    evals = blocks(tok.encode(etext, add_special_tokens=False), args.seq_len, args.eval_blocks)
    work = Path(tempfile.mkdtemp(prefix="zeal-peers-"))
    try:
        save_file({"calib": calib, "evals": evals}, str(work / "data.safetensors"))
        job = {"model": str(src), "data": str(work / "data.safetensors"), "work": str(work), "threads": threads,
               "calibration_py": calibration.__file__}
        dense = perplexity(base, evals)
        dense_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        rows, zeal_masks = [], {}
        for name, spec in ZEAL_RUNS.items():
            model, seconds, masks = _zeal_run(base, calib, spec)
            row = {"tool": "zeal", "run": name, "beside": name, "ppl": perplexity(model, evals), "seconds": seconds,
                   "bytes": _export_bytes(model, src, work / "zeal_out", spec)}
            if masks:
                zeal_masks[name] = {k: v.bool() for k, v in masks.items()}
                row.update(_sparsity_facts(model, None))
            rows.append(row)
            print(f"zeal {name}: ppl {row['ppl']:.3f} in {seconds:.1f} s", flush=True)
            del model
        versions = {}
        for tool, python, script, table, picked in (
                ("llm-compressor", args.llmc, "_llmc_side.py", LLMC_RUNS, args.llmc_runs),
                ("torchao", args.torchao, "_torchao_side.py", TORCHAO_RUNS, args.torchao_runs)):
            if not python:
                continue
            runs = [r for r in picked.split(",") if r]
            bad = [r for r in runs if r not in table]
            if bad:
                raise SystemExit(f"unknown {tool} runs: {bad} (known: {list(table)})")
            t0 = time.perf_counter()
            out = _side(python, script, {**job, "mode": "oneshot", "runs": runs}, work, args.peer_timeout)
            versions[tool] = out["versions"]
            print(f"{tool} side: {time.perf_counter() - t0:.0f} s, {out['versions']}", flush=True)
            for run in runs:
                res = out["runs"].get(run, {"error": "not reached before the side's timeout"})
                rows.append(_row(tool, run, res, table[run], base, evals, zeal_masks))
        _print(rows, dense, dense_bytes)
        print(json.dumps({"args": vars(args), "dense_ppl": dense, "dense_bytes": dense_bytes, "versions": versions,
                          "rows": rows}))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
