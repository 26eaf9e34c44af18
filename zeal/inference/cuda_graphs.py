"""CUDA graphs for decode steps: captured once per batch-size bucket, then replayed.

A decode step of ``n`` sequences runs the graph of the smallest bucket ``>= n`` (vLLM's
buckets: 1, 2, 4, then every multiple of 8 up to ``max_num_seqs``): its inputs are
copied into static buffers (rows ``n`` to the bucket padded with harmless values: token
0 at position 0 writing into a scratch cache slot, attending one slot of block 0), the
graph replays, and rows ``:n`` of its static output are the logits. Graphs are captured
lazily, the first time a bucket is needed (after one eager warm-up run, which also
compiles any ``torch.compile`` kernel outside the capture). Prefill and mixed steps, a
batch beyond the largest bucket, and ``enforce_eager`` run eagerly.

:class:`DecodeGraphs` holds only the bookkeeping (buckets, padding, static buffers,
capture and replay) over a ``forward(static_inputs) -> Tensor`` function and a graph
factory, so that it is tested on CPU with a fake graph; on CUDA the factory is
:func:`cuda_graph_factory` (``torch.cuda.CUDAGraph`` on a shared memory pool).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger("zeal.inference")


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes a graph is captured for: 1, 2, 4, 8, 16, 24, ... up to ``max_num_seqs``
    (which is always the last bucket)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sorted({*sizes, max_num_seqs})


@dataclass
class InputSpec:
    """A static input: per-row trailing ``shape``, ``dtype`` and the value padding rows take."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pad: int | float = 0


class _Replay:
    """A captured graph and the static output it writes."""

    def __init__(self, graph, output: torch.Tensor) -> None:
        self.graph, self.output = graph, output


class FakeGraph:
    """A stand-in for ``torch.cuda.CUDAGraph`` on CPU: capturing records the function and
    its output tensor; replaying re-runs it on the same static buffers and writes the
    result into that output tensor (what a replay does)."""

    def __init__(self) -> None:
        self.fn: Callable[[], torch.Tensor] | None = None
        self.out: torch.Tensor | None = None
        self.replays = 0

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self) -> None:
        self.replays += 1
        self.out.copy_(self.fn())


class _CudaGraph:
    """``torch.cuda.CUDAGraph`` behind the :class:`FakeGraph` interface."""

    def __init__(self, pool) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


def cuda_graph_factory() -> Callable[[], object]:
    """Graphs sharing one memory pool (captured largest-first, smaller buckets reuse it)."""
    pool = torch.cuda.graph_pool_handle() if torch.cuda.is_available() else None
    return lambda: _CudaGraph(pool)


class DecodeGraphs:
    """Decode steps through graphs captured per batch-size bucket (see the module docstring).

    ``forward(inputs)``: the step over a dict of input tensors whose first dimension is the
    batch (the same function runs eagerly and under capture); ``specs``: each input's
    :class:`InputSpec`; ``graph_factory``: a new graph (CUDA or :class:`FakeGraph`)."""

    def __init__(self, forward: Callable[[dict[str, torch.Tensor]], torch.Tensor], specs: dict[str, InputSpec],
                 max_num_seqs: int, device: torch.device, graph_factory: Callable[[], object],
                 enforce_eager: bool = False) -> None:
        self.forward = forward
        self.specs = specs
        self.buckets = decode_buckets(max_num_seqs)
        self.enforce_eager = enforce_eager
        self.graph_factory = graph_factory
        top = self.buckets[-1]
        self.static = {k: torch.full((top, *s.shape), s.pad, dtype=s.dtype, device=device) for k, s in specs.items()}
        self.graphs: dict[int, _Replay] = {}
        self.stats = {"eager": 0, "replay": 0, "capture": 0}

    def reset(self) -> None:
        """Forget the captured graphs (they hold the addresses of the KV cache and weights,
        which sleep/wake reallocates); the next decode steps capture them again."""
        self.graphs.clear()

    def bucket_for(self, n: int) -> int | None:
        """The smallest bucket holding ``n`` rows; None: beyond the largest (eager)."""
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def _fill(self, inputs: dict[str, torch.Tensor], n: int, bucket: int) -> dict[str, torch.Tensor]:
        views = {}
        for k, buf in self.static.items():
            src = inputs[k]
            if src.shape[1:] != buf.shape[1:]:
                raise ValueError(f"decode graph input {k!r}: rows of shape {tuple(src.shape[1:])}, "
                                 f"the static buffer's are {tuple(buf.shape[1:])}")
            buf[:n].copy_(src, non_blocking=True)
            buf[n:bucket].fill_(self.specs[k].pad)
            views[k] = buf[:bucket]
        return views

    def _capture(self, bucket: int, views: dict[str, torch.Tensor]) -> _Replay:
        self.forward(views)  # warm-up: lazy initialisation and kernel compilation happen outside the capture
        graph = self.graph_factory()
        out = graph.capture(lambda: self.forward(views))
        self.stats["capture"] += 1
        return _Replay(graph, out)

    def run(self, inputs: dict[str, torch.Tensor], decode_only: bool = True) -> torch.Tensor:
        """The step's output for ``inputs`` (first dimension: its ``n`` rows); a graph
        replay when it is a decode-only step of a bucketed size, else an eager call."""
        n = next(iter(inputs.values())).shape[0]
        bucket = self.bucket_for(n)
        if self.enforce_eager or not decode_only or bucket is None:
            self.stats["eager"] += 1
            return self.forward(inputs)
        views = self._fill(inputs, n, bucket)
        if self.graph_factory is None:  # a compiled step without graphs (CPU): run at the bucket's shape
            self.stats["compiled"] = self.stats.get("compiled", 0) + 1
            return self.forward(views)[:n]
        rep = self.graphs.get(bucket)
        if rep is None:
            rep = self.graphs[bucket] = self._capture(bucket, views)
            return rep.output[:n]
        rep.graph.replay()
        self.stats["replay"] += 1
        return rep.output[:n]


def runner_decode_graphs(runner, max_num_seqs: int, max_seq_tokens: int, enforce_eager: bool = False,
                         graph_factory: Callable[[], object] | None = None, compile: bool = False) -> DecodeGraphs:
    """:class:`DecodeGraphs` over the decode steps of ``runner`` (a ModelRunner with the
    batched attention backend and a scratch cache block): inputs ids, positions, slots,
    block tables padded to ``ceil(max_seq_tokens / block_size)`` and context lengths;
    padding rows write into the scratch block and attend one slot of block 0.

    ``compile``: the step is ``torch.compile``d (dynamic=False: one compiled shape per
    bucket, see :mod:`zeal.inference.compiled_decode`): with the flex attention backend
    inside the graph, or with the fused CPU kernels' attention left out of it (the layers'
    other ops then compile from torch ops); off CUDA it runs without graphs."""
    from zeal.inference.attention import AttentionMetadata, DecodeTables, PagedAttention
    from zeal.inference.compiled_decode import compile_step, outside_graph
    from zeal.inference.paged_flex import FlexPagedAttention

    bs = runner.block_size
    width = -(-max_seq_tokens // bs)
    specs = {"ids": InputSpec((), torch.int64), "pos": InputSpec((), torch.int64),
             "slots": InputSpec((), torch.int64, runner.scratch_slot), "tables": InputSpec((width,), torch.int32),
             "lens": InputSpec((), torch.int32, 1)}

    backend = runner.attn_backend
    # compiled with the fused CPU kernels: their attention runs outside the graph (OpaqueAttention)
    opaque = compile and runner.kernels is not None and backend is None
    opaque_attention = outside_graph() if opaque else None
    if compile and not opaque:
        backend = backend or FlexPagedAttention()

    def forward(inp: dict[str, torch.Tensor]) -> torch.Tensor:
        n = inp["ids"].shape[0]
        meta = AttentionMetadata(slot_mapping=inp["slots"], kernels=runner.kernels, backend=backend)
        meta.decodes = DecodeTables(slice(0, n), inp["tables"], inp["lens"])
        attention = PagedAttention(runner.k_cache, runner.v_cache, meta)
        if opaque_attention is not None:
            attention = opaque_attention(attention)
        return runner.model(inp["ids"], positions=inp["pos"], attention=attention)

    step = compile_step(forward, len(decode_buckets(max_num_seqs)), runner.model.num_layers) if compile else forward
    cuda = runner.device.type == "cuda" and torch.cuda.is_available()
    factory = graph_factory or (cuda_graph_factory() if cuda or not compile else None)
    return DecodeGraphs(step, specs, max_num_seqs, runner.device, factory, enforce_eager)


def enable_for_engine(runner, model, max_num_seqs: int, max_seq_tokens: int, enforce_eager: bool,
                      tensor_parallel: bool, compile: bool = False) -> bool:
    """Turn on decode graphs where they apply: CUDA with the batched attention backend, one
    process, resident weights, not ``enforce_eager``; ``compile`` (the engine's
    compilation level, :func:`zeal.inference.compiled_decode.compile_level`): their step
    compiled, and on CPU the compiled step without graphs. Returns whether either is on."""
    if enforce_eager or tensor_parallel or getattr(model, "weight_streamer", None) is not None:
        return False
    cuda = runner.device.type == "cuda" and torch.cuda.is_available()
    if compile and not cuda and (runner.kernels is None or runner.attn_backend is not None):
        compile = False  # on CPU the compiled step keeps the fused kernels' attention (see compiled_decode)
        log.warning("compilation_config: a compiled decode step on CPU needs the fused CPU kernels and the "
                    "default attention; decoding eagerly")
    if compile and cuda and runner.attn_backend is None:
        compile = False  # ZEAL_ATTENTION_BACKEND=torch: the reference path, as chosen, eagerly
    if not compile and (runner.attn_backend is None or not cuda):
        return False
    runner.enable_decode_graphs(max_num_seqs, max_seq_tokens, compile=compile)
    return True
