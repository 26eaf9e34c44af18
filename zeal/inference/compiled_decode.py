"""``torch.compile`` of the decode step (vLLM's ``compilation_config`` level).

The decode step of :func:`zeal.inference.cuda_graphs.runner_decode_graphs` (the model over
a batch of single-token rows, attending through the block tables) is compiled with
``dynamic=False``: each batch-size bucket of the decode graphs (1, 2, 4, 8, 16, ...) gets
its own compiled shape, compiled the first time the bucket runs (on CUDA, in the warm-up
run before its graph is captured). The compiled step runs torch ops (the fused CPU kernels
are opaque to the compiler) and the flex paged attention, which inductor fuses into one
kernel. Prefill and mixed steps stay eager.

Defaults: level 3 on CUDA (vLLM's), 0 on CPU, where the eager step with the fused kernels
is faster (``bench/inference/bench_decode_modes.py``); ``enforce_eager`` turns it off.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zeal.config.inference import EngineConfig


def compile_level(cfg: EngineConfig, device: torch.device) -> int:
    """The engine's compilation level: 0 with ``enforce_eager``, else the configured one,
    else 3 on CUDA and 0 elsewhere."""
    if cfg.enforce_eager:
        return 0
    if cfg.compilation_config is not None:
        return cfg.compilation_config
    return 3 if device.type == "cuda" and torch.cuda.is_available() else 0


def _allow_recompiles(n: int) -> None:
    """Room for ``n`` compiled shapes of one function (dynamo's per-function limit is 8)."""
    import torch._dynamo

    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < n:
            setattr(cfg, name, n)


def compile_step(forward: Callable[[dict[str, torch.Tensor]], torch.Tensor], num_buckets: int
                 ) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    """``forward`` compiled with one static shape per batch-size bucket (``num_buckets``)."""
    _allow_recompiles(num_buckets + 2)
    return torch.compile(forward, dynamic=False)
