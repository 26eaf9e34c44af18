"""The torchao side of ``bench_peers.py``: run in torchao's own venv (never a zeal dependency).

``python _torchao_side.py JOB.json RESULT.json``. Each run takes a fresh fp32 copy of
the HF folder, applies one torchao transform (the time recorded), takes the held-out
perplexity with its own forward where it runs on this CPU (zeal's perplexity function,
zeal's evaluation blocks) and writes its linears as dense fp32 safetensors (quantized
tensors through their own ``dequantize``) for zeal to evaluate with its own model.
A transform that fails here (2:4 semi-structured tensors and the int4 packings need
CUDA kernels) is reported with its exact error.

Bytes are the storage of the model's tensors as torchao holds them (a tensor subclass
counted by its inner tensors): torchao has no compressed folder format of its own.
"""

from __future__ import annotations

import json
from importlib.metadata import version

import torch
from _side_common import calibration_module, dump_linears, error_line, read_job, timed, token_blocks
from torch import nn


def _linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and not n.endswith("lm_head")]


def _not_head(module: nn.Module, fqn: str) -> bool:
    return isinstance(module, nn.Linear) and not fqn.endswith("lm_head")


def _state_bytes(model: nn.Module) -> int:
    def size(t: torch.Tensor) -> int:
        if type(t) in (torch.Tensor, nn.Parameter):
            return t.numel() * t.element_size()
        names, _ = t.__tensor_flatten__()
        return sum(size(getattr(t, k)) for k in names)

    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:  # the tied head counted once
            seen.add(id(t))
            total += size(t.detach())
    return total


def _wanda(model: nn.Module, calib: torch.Tensor) -> None:
    from torchao.sparsity.wanda import WandaSparsifier

    sparsifier = WandaSparsifier(sparsity_level=0.5, semi_structured_block_size=4)
    sparsifier.prepare(model, [{"tensor_fqn": f"{n}.weight"} for n, _ in _linears(model)])
    with torch.no_grad():
        for x in calib:
            model(x[None])
    sparsifier.step()
    sparsifier.squash_mask()


def _transform(run: str, model: nn.Module, calib: torch.Tensor) -> None:
    from torchao.quantization import (
        Int4WeightOnlyConfig,
        Int8WeightOnlyConfig,
        IntxWeightOnlyConfig,
        quantize_,
    )
    from torchao.quantization.granularity import PerGroup
    from torchao.sparsity.sparse_api import SemiSparseWeightConfig, apply_fake_sparsity, sparsify_

    if run == "2:4 semi-structured":
        sparsify_(model, SemiSparseWeightConfig(), _not_head)
    elif run == "2:4 magnitude (fake sparsity)":
        apply_fake_sparsity(model, filter_fn=_not_head)
    elif run == "2:4 wanda":
        _wanda(model, calib)
    elif run == "int8 weight-only":
        quantize_(model, Int8WeightOnlyConfig(), _not_head)
    elif run.startswith("int4 weight-only g"):  # the int4 packings (tinygemm, mslk)
        quantize_(model, Int4WeightOnlyConfig(group_size=int(run.rsplit("g", 1)[1])), _not_head)
    elif run.startswith("intx int4 g"):  # int4 codes held one per int8
        gs = int(run.rsplit("g", 1)[1])
        quantize_(model, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(gs)), _not_head)
    else:
        raise ValueError(f"unknown torchao run {run!r}")


def _run(job: dict, run: str, calib: torch.Tensor, evals: torch.Tensor, cal) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32).eval()
    _, seconds = timed(lambda: _transform(run, model, calib))
    row = {"seconds": seconds, "bytes": _state_bytes(model),
           "weight_type": type(_linears(model)[0][1].weight).__name__}
    try:
        row["own_ppl"] = cal.perplexity(model, evals)
    except Exception as e:
        row["own_error"] = error_line(e)
    weights = f"{job['work']}/torchao_{run.split(' (')[0].replace(' ', '_').replace(':', '')}.safetensors"
    dump_linears(model, weights)
    row["weights"] = weights
    return row


def main() -> int:
    job, result = read_job()
    torch.set_num_threads(job.get("threads", torch.get_num_threads()))
    cal = calibration_module(job["calibration_py"])
    calib, evals = token_blocks(job)
    out = {"versions": {p: version(p) for p in ("torchao", "transformers", "torch")}, "runs": {}}
    for run in job["runs"]:
        try:
            out["runs"][run] = _run(job, run, calib, evals, cal)
        except Exception as e:  # a peer's failure is a result to report, not a crash
            out["runs"][run] = {"error": error_line(e)}
        print(f"torchao {run}: {out['runs'][run]}", flush=True)
        result.write_text(json.dumps(out, indent=1))  # what is done survives a timeout
    result.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
