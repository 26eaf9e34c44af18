"""What the peer side scripts share (run inside a peer's own venv, never zeal's).

zeal itself is not imported there (its package needs zeal's dependencies); only its
dependency-free perplexity function is loaded from its file, so every side evaluates
with the very function zeal's benchmark uses. Jobs and results travel as JSON,
token blocks and weights as safetensors (no pickle).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def calibration_module(path: str):
    """zeal/compression/calibration.py, loaded from its file (torch only)."""
    spec = importlib.util.spec_from_file_location("zeal_calibration", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def read_job() -> tuple[dict, Path]:
    """``(job, result path)`` from ``argv[1:3]``."""
    return json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])


def token_blocks(job: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The calibration and evaluation blocks zeal's benchmark wrote."""
    data = load_file(job["data"])
    return data["calib"], data["evals"]


def folder_bytes(folder: str | Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))


def dump_linears(model: torch.nn.Module, path: str | Path, exclude: str = "lm_head") -> int:
    """The dense fp32 weights of every linear but the head, by HF name (a quantized
    tensor subclass dequantized by its own ``dequantize``); how many."""
    sd = {}
    for n, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and not n.endswith(exclude):
            w = m.weight.detach()
            if type(w) not in (torch.Tensor, torch.nn.Parameter):
                w = w.dequantize()
            sd[f"{n}.weight"] = w.float().contiguous().clone()
    save_file(sd, str(path))
    return len(sd)


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def error_line(e: BaseException) -> str:
    lines = [x for x in str(e).strip().splitlines() if x.strip()]
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"
