"""DeepSpeed's ``flops_profiler`` section: the FLOPs of one training step, per module.

At optimizer step ``profile_step`` the profiler counts, with ``torch.utils.flop_counter``,
every operator of every forward and backward from the step's first forward to its
optimizer step (recomputation under activation checkpointing included, as it runs), then
reports the total, the step's wall time and achieved TFLOP/s, and the modules with the
most FLOPs at each depth. The report goes to ``output_file`` (rank 0) or the log; the
figures stay on the hook as :attr:`FlopsProfiler.result`.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop, sdpa_flop

from zeal.config.schema import FlopsProfilerConfig

log = logging.getLogger("zeal.train")


class FlopsProfiler:
    """A step hook plus a forward pre-hook on the model (see the module's docstring)."""

    def __init__(self, model: nn.Module, section: FlopsProfilerConfig, rank: int = 0) -> None:
        self.section, self.rank, self.model = section, rank, model
        self.steps_done = 0
        self.mode: FlopCounterMode | None = None
        self.result: dict | None = None
        self._t0 = 0.0
        self._handle = model.register_forward_pre_hook(self._begin)

    def _begin(self, _module: nn.Module, _args: tuple) -> None:
        if self.mode is None and self.result is None and self.steps_done + 1 == self.section.profile_step:
            depth = self.section.module_depth if self.section.module_depth >= 0 else 99
            self.mode = FlopCounterMode(display=False, depth=depth, custom_mapping=cpu_attention_formulas())
            self.mode.__enter__()
            self._t0 = time.perf_counter()

    def after_step(self, applied: bool) -> None:
        self.steps_done += 1
        if self.mode is None:
            return
        mode, self.mode = self.mode, None
        mode.__exit__(None, None, None)
        seconds = time.perf_counter() - self._t0
        self.result = summarize(mode, seconds, self.section, sum(p.numel() for p in self.model.parameters()))
        if self.rank == 0:
            self._report()

    def _report(self) -> None:
        r = self.result
        lines = [f"flops profiler (step {self.section.profile_step}): {r['flops']:.4g} FLOPs in {r['seconds']:.3f} s "
                 f"= {r['tflops']:.4g} TFLOP/s, {r['params']:,} parameters"]
        for m in r["modules"]:
            ops = f"  {json.dumps(m['ops'])}" if self.section.detailed else ""
            lines.append(f"  depth {m['depth']}: {m['module'] or '(model)'}: {m['flops']:.4g} FLOPs "
                         f"({m['share']:.1%}){ops}")
        text = "\n".join(lines)
        if self.section.output_file:
            Path(self.section.output_file).parent.mkdir(parents=True, exist_ok=True)
            Path(self.section.output_file).write_text(text + "\n")
        else:
            log.info(text)

    def close(self) -> None:
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.mode = None
        self._handle.remove()


def cpu_attention_formulas() -> dict:
    """torch's FLOP formulas for its CPU flash-attention kernels, which its counter leaves
    out (it counts the CUDA ones): the same counts as any other SDPA."""
    aten = torch.ops.aten
    out = {}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        out[aten._scaled_dot_product_flash_attention_for_cpu] = _raw(sdpa_flop)
        out[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _raw(sdpa_backward_flop)
    return out


def _raw(formula):
    """torch's registered formulas already take the operator's own arguments: marked raw,
    the counter hands them over as they are (it would wrap them a second time)."""
    def count(*args, **kwargs):
        return formula(*args, **kwargs)

    count._get_raw = True
    return count


def summarize(mode: FlopCounterMode, seconds: float, section: FlopsProfilerConfig, params: int) -> dict:
    """The counter's figures: total, rate, and the ``top_modules`` modules of each depth."""
    counts = mode.get_flop_counts()
    total = sum(counts.get("Global", {}).values())
    per_depth: dict[int, list[dict]] = {}
    for name, ops in counts.items():
        if name == "Global":
            continue
        depth = name.count(".")
        flops = sum(ops.values())
        per_depth.setdefault(depth, []).append({"module": name, "depth": depth, "flops": flops,
                                                "share": flops / total if total else 0.0,
                                                "ops": {str(k).split(".")[-1]: v for k, v in ops.items()}})
    modules = []
    for depth in sorted(per_depth):
        if section.module_depth >= 0 and depth > section.module_depth:
            break
        modules += sorted(per_depth[depth], key=lambda m: -m["flops"])[:section.top_modules]
    return {"flops": total, "seconds": seconds, "tflops": total / max(seconds, 1e-12) / 1e12, "params": params,
            "modules": modules}
