"""The llm-compressor side of ``bench_peers.py`` and ``check_export_peers.py``: run in
llm-compressor's own venv (never a zeal dependency).

``python _llmc_side.py JOB.json RESULT.json``; a job has ``runs``, ``folders`` or both:

- ``runs``: for each run (``sparsegpt``/``wanda`` 2:4, ``gptq``/``rtn`` W8A16 per channel
  and W4A16 with group 64), a fresh copy of the HF folder is compressed by ``llmcompressor.oneshot`` on
  zeal's calibration blocks (the time recorded), its held-out perplexity taken with its
  own forward (zeal's perplexity function, zeal's evaluation blocks), saved compressed
  (``save_compressed=True``, the bytes recorded), reloaded through transformers +
  compressed-tensors with ``dequantize=True`` and its linears written as dense fp32
  safetensors for zeal to evaluate with its own model (``keep_saved``: the saved folder
  is kept, e.g. for vLLM to load as a control);
- ``folders``: each folder zeal exported is read with that same loader and its dense
  linears written out (zeal compares them to its own dequantized weights).
"""

from __future__ import annotations

import json
import shutil
from importlib.metadata import version
from pathlib import Path

import torch
from _side_common import (
    calibration_module,
    dump_linears,
    error_line,
    folder_bytes,
    read_job,
    timed,
    token_blocks,
)


def _recipe(run: str):
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.pruning import SparseGPTModifier, WandaPruningModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier

    kind, arg, *group = run.split(" ")
    scheme = arg.upper()
    if group:  # "w4a16 g64" / "w8a16 ch": symmetric int weights by group or channel (the presets'
        # group of 128 does not divide SmolLM2's 576 columns, and llm-compressor refuses it)
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        by = {"strategy": "channel"} if group[0] == "ch" else {"strategy": "group", "group_size": int(group[0][1:])}
        w = QuantizationArgs(num_bits=int(arg[1]), type="int", symmetric=True, **by)
        scheme = {"group_0": QuantizationScheme(targets=["Linear"], weights=w)}
    quant = {"config_groups": scheme} if group else {"scheme": scheme}
    if kind == "sparsegpt":
        return SparseGPTModifier(sparsity=0.5, mask_structure=arg, targets=["Linear"], ignore=["lm_head"])
    if kind == "wanda":
        return WandaPruningModifier(sparsity=0.5, mask_structure=arg, targets=["Linear"], ignore=["lm_head"])
    if kind == "gptq":
        return GPTQModifier(targets="Linear", ignore=["lm_head"], **quant)
    if kind == "rtn":
        return QuantizationModifier(targets="Linear", ignore=["lm_head"], **quant)
    raise ValueError(f"unknown llm-compressor run {run!r}")


def _load(folder: str | Path, dequantize: bool = False):
    from transformers import AutoModelForCausalLM

    kw = {}
    if dequantize:
        from transformers import CompressedTensorsConfig

        kw["quantization_config"] = CompressedTensorsConfig(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, **kw).eval()


def _oneshot(job: dict, run: str, calib: torch.Tensor, evals: torch.Tensor, cal) -> dict:
    from llmcompressor import oneshot
    from llmcompressor.core import reset_session

    reset_session()
    model = _load(job["model"])
    rows = [{"input_ids": x, "attention_mask": torch.ones_like(x)} for x in calib]
    loader = torch.utils.data.DataLoader(rows, batch_size=1, shuffle=False)  # zeal's blocks as they are
    _, seconds = timed(lambda: oneshot(model=model, dataset=loader, recipe=_recipe(run),
                                       num_calibration_samples=len(loader), max_seq_length=calib.shape[1]))
    own = cal.perplexity(model, evals)
    slug = run.replace(" ", "_").replace(":", "")
    saved = Path(job["work"]) / f"llmc_{slug}"
    model.save_pretrained(str(saved), save_compressed=True)
    cfg = json.loads((saved / "config.json").read_text()).get("quantization_config") or {}
    nbytes = folder_bytes(saved)
    model = None  # free it before the reload
    dense = _load(saved, dequantize=bool(cfg.get("config_groups")))  # sparsity alone: a plain folder
    weights = Path(job["work"]) / f"llmc_{slug}.safetensors"
    dump_linears(dense, weights)
    if not job.get("keep_saved"):
        shutil.rmtree(saved)
    return {"seconds": seconds, "own_ppl": own, "bytes": nbytes, "weights": str(weights), "saved": str(saved),
            "format": cfg.get("format"), "sparsity_config": cfg.get("sparsity_config")}


def main() -> int:
    job, result = read_job()
    torch.set_num_threads(job.get("threads", torch.get_num_threads()))
    out = {"versions": {p: version(p) for p in ("llmcompressor", "compressed-tensors", "transformers", "torch")},
           "runs": {}, "loads": {}}
    if job.get("runs"):
        cal = calibration_module(job["calibration_py"])
        calib, evals = token_blocks(job)
        for run in job["runs"]:
            try:
                out["runs"][run] = _oneshot(job, run, calib, evals, cal)
            except Exception as e:  # a peer's failure is a result to report, not a crash
                out["runs"][run] = {"error": error_line(e)}
            print(f"llm-compressor {run}: {out['runs'][run]}", flush=True)
            result.write_text(json.dumps(out, indent=1))  # what is done survives a timeout
    if job.get("folders"):  # load mode (and the control folders of a oneshot job, when asked)
        for name, folder in job["folders"].items():
            try:
                weights = Path(job["work"]) / f"llmc_load_{name}.safetensors"
                quantized = "quantization_config" in json.loads((Path(folder) / "config.json").read_text())
                model, seconds = timed(lambda f=folder, q=quantized: _load(f, dequantize=q))
                dump_linears(model, weights)
                out["loads"][name] = {"weights": str(weights), "seconds": seconds}
            except Exception as e:
                out["loads"][name] = {"error": error_line(e)}
    result.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
