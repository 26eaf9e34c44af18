"""``torch.compile`` of the decode step (vLLM's ``compilation_config`` level).

The decode step of :func:`zeal.inference.cuda_graphs.runner_decode_graphs` (the model over
a batch of single-token rows, attending through the block tables) is compiled with
``dynamic=False``: each batch-size bucket of the decode graphs (1, 2, 4, 8, 16, ...) gets
its own compiled shape, compiled the first time the bucket runs (on CUDA, in the warm-up
run before its graph is captured). With the flex paged attention (CUDA) the whole step is
one graph; on CPU the fused attention kernel stays outside it (:class:`OpaqueAttention`) and
the rest of each layer (norms, RoPE, MLP) compiles from torch ops. Prefill and mixed steps
stay eager.

Defaults: level 3 on CUDA (vLLM's), 0 on CPU, where the eager step with the fused kernels
is faster (``bench/inference/bench_decode_modes.py``); ``enforce_eager`` turns it off.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from zeal.config.inference import EngineConfig

log = logging.getLogger("zeal.inference")


class OpaqueAttention:
    """The paged attention of a compiled step kept out of the compiled graph (vLLM's piecewise
    compilation splits its graph at attention too): the fused CPU kernels it calls are opaque to
    the compiler. ``ops`` None: the layers' norms, RoPE and activations are torch ops, compiled."""

    ops = None

    def __init__(self, inner) -> None:
        self.inner = inner

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 dropout_p: float = 0.0) -> torch.Tensor:
        return self.inner(layer_idx, q, k, v, dropout_p)


@functools.cache
def outside_graph() -> type[OpaqueAttention]:
    """:class:`OpaqueAttention` with its call disabled for the compiler (the graph breaks at
    the layer's call). Made on first use, not by a decorator on the class:
    ``torch.compiler.disable`` imports dynamo (~1.4 s of every serving process's start),
    which only an engine that compiles needs. Call it outside the compiled function."""
    call = torch.compiler.disable(OpaqueAttention.__call__)
    return type("OpaqueAttention", (OpaqueAttention,), {"__call__": call})


def compile_level(cfg: EngineConfig, device: torch.device) -> int:
    """The engine's compilation level: 0 with ``enforce_eager``, else the configured one,
    else 3 on CUDA and 0 elsewhere."""
    if cfg.enforce_eager:
        return 0
    if cfg.compilation_config is not None:
        return cfg.compilation_config
    return 3 if device.type == "cuda" and torch.cuda.is_available() else 0


def _allow_recompiles(n: int) -> None:
    """Room for ``n`` compiled versions of one function (dynamo's per-function limit is 8): a
    bucket's shapes, and on CPU each layer's code resumed after its attention (the layer index
    is a constant of its graph), once per bucket."""
    import torch._dynamo

    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < n:
            setattr(cfg, name, n)


class CompiledStep:
    """``forward`` compiled with one static shape per batch-size bucket. When compiling fails
    (a backend missing, an op the compiler cannot lower), the step logs it once and runs
    eagerly from then on (``failed`` holds the error) rather than failing the requests."""

    def __init__(self, forward: Callable[[dict[str, torch.Tensor]], torch.Tensor], num_buckets: int,
                 num_layers: int = 1) -> None:
        _allow_recompiles(num_buckets * (num_layers + 2) + 8)
        self.forward = forward
        self.compiled = torch.compile(forward, dynamic=False)
        self.failed: str | None = None

    def __call__(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.failed is None:
            try:
                return self.compiled(inputs)
            except Exception as e:  # noqa: BLE001 - the eager step computes the same
                self.failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                log.warning("torch.compile of the decode step failed (%s): decoding eagerly", self.failed)
        return self.forward(inputs)


def compile_step(forward: Callable[[dict[str, torch.Tensor]], torch.Tensor], num_buckets: int,
                 num_layers: int = 1) -> CompiledStep:
    """``forward`` (a model of ``num_layers`` layers) compiled with one static shape per
    batch-size bucket (``num_buckets``)."""
    return CompiledStep(forward, num_buckets, num_layers)
