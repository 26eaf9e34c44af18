"""``PipelineModule``: a model given as a list of layers, of which each rank builds only its stage's.

Shaped like DeepSpeed's ``deepspeed.pipe.PipelineModule``::

    model = PipelineModule(layers=[LayerSpec(nn.Embedding, V, D), *[LayerSpec(Block, D) for _ in range(8)],
                                   LayerSpec(Head, D, V)],
                           loss_fn=nn.CrossEntropyLoss(), num_stages=2, partition_method="parameters")

A layer is a module, a :class:`LayerSpec` (built only on the rank whose stage holds
it) or any callable (a function without parameters). The layers are split into
``num_stages`` contiguous ranges, by balanced parameter counts (``"parameters"``) or
equal layer counts (``"uniform"``). Layer ``i`` is ``self.layers[i]`` on every rank
(a parameter-free placeholder where another stage holds it), so a parameter keeps
the same global name, ``layers.<i>.<name>``, whatever the number of stages: a
checkpoint saved with pipeline stages loads without them.

Each stage's forward takes one tensor (the batch's inputs on the first stage, the
previous stage's output elsewhere) and returns one tensor; the last stage's output
and the batch's labels go to ``loss_fn(output, labels)``.

With ``virtual_stages=V`` (for the interleaved schedule) the layers are split into
``num_stages·V`` ranges and stage ``s`` builds ranges ``s, s + num_stages, ...``, its
model chunks; ``forward(x, chunk=c)`` runs chunk ``c``'s layers.

As in DeepSpeed, ``seed_layers=True`` builds layer ``i`` under the seed ``base_seed + i``,
so its initial values do not depend on which layers this rank builds (the global RNG
is left as it was). ``activation_checkpoint_interval=k`` recomputes each group of ``k``
of this stage's layers in backward (DeepSpeed's keyword).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from zeal.utils.meta import meta_device


class LayerSpec:
    """A layer to build later: ``LayerSpec(cls, *args, **kwargs).build()`` is ``cls(*args, **kwargs)``."""

    def __init__(self, typename: Callable[..., nn.Module], *args: Any, **kwargs: Any) -> None:
        if not callable(typename):
            raise TypeError(f"LayerSpec needs a class or factory, got {type(typename).__name__}")
        self.typename, self.args, self.kwargs = typename, args, kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.args, **self.kwargs)

    def __repr__(self) -> str:
        return f"LayerSpec({getattr(self.typename, '__name__', self.typename)})"


class _Fn(nn.Module):
    """A parameter-free callable as a layer."""

    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: Any) -> Any:
        return self.fn(x)


def count_parameters(layer: Any) -> int:
    """Parameters of a layer; a LayerSpec is built on the meta device to count them."""
    if isinstance(layer, LayerSpec):
        with meta_device():
            layer = layer.build()
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters())
    return 0


def partition_uniform(num_items: int, parts: int) -> list[int]:
    """Boundaries ``[0, b1, ..., num_items]`` of ``parts`` contiguous ranges whose sizes
    differ by at most one (the earlier ranges take the extra items)."""
    _check_parts(num_items, parts)
    base, extra = divmod(num_items, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


def partition_balanced(weights: Sequence[int], parts: int) -> list[int]:
    """Boundaries of ``parts`` contiguous non-empty ranges minimising the largest range's
    total weight (exact, by dynamic programming; ties: the earliest boundaries)."""
    n = len(weights)
    _check_parts(n, parts)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the smallest max-weight splitting the first i items into k ranges
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def _check_parts(n: int, parts: int) -> None:
    if parts < 1 or n < parts:
        raise ValueError(f"cannot split {n} layers into {parts} pipeline stages (each stage needs a layer)")


class PipelineModule(nn.Module):
    """The layers of stage ``stage_id`` (default: this rank's pipeline coordinate from
    torchrun's RANK and WORLD_SIZE, pipeline stages being the mesh's outermost dimension)
    of ``num_stages``; see the module docstring. ``forward(x)`` runs this stage's layers."""

    def __init__(self, layers: Sequence[Any], loss_fn: Callable | None = None, num_stages: int | None = None,
                 partition_method: str = "parameters", stage_id: int | None = None, seed_layers: bool = False,
                 base_seed: int = 1234, activation_checkpoint_interval: int = 0, virtual_stages: int = 1) -> None:
        super().__init__()
        if not layers:
            raise ValueError("PipelineModule needs at least one layer")
        if num_stages is None:
            raise ValueError("PipelineModule needs num_stages (the config's pipeline_parallel.size)")
        if virtual_stages < 1 or virtual_stages > 1 and len(layers) < num_stages * virtual_stages:
            raise ValueError(f"{len(layers)} layers do not divide into num_stages {num_stages} x virtual_stages "
                             f"{virtual_stages} non-empty chunks")
        self.num_stages, self.virtual_stages = num_stages, virtual_stages
        self.loss_fn = loss_fn
        method = partition_method.lower()
        parts = num_stages * virtual_stages
        if method == "parameters":
            self.parts = partition_balanced([count_parameters(x) for x in layers], parts)
        elif method == "uniform":
            self.parts = partition_uniform(len(layers), parts)
        else:
            raise ValueError(f"partition_method {partition_method!r}: use 'parameters' or 'uniform'")
        self.stage_id = _env_stage(self.num_stages) if stage_id is None else stage_id
        if not 0 <= self.stage_id < self.num_stages:
            raise ValueError(f"stage_id {self.stage_id} is not a stage of {self.num_stages}")
        self._chunks = [self.chunk_layers(self.stage_id, c) for c in range(virtual_stages)]
        mine = {i for r in self._chunks for i in r}
        self.layers = nn.ModuleList(_as_module(x, base_seed + i if seed_layers else None) if i in mine
                                    else nn.Identity() for i, x in enumerate(layers))
        self.activation_checkpoint_interval = activation_checkpoint_interval

    def stage_layers(self, stage: int) -> range:
        """The global indices of the layers of ``stage`` (its chunk 0 with virtual stages)."""
        return self.chunk_layers(stage, 0)

    def chunk_layers(self, stage: int, chunk: int) -> range:
        """The global indices of the layers of ``stage``'s model chunk ``chunk``."""
        v = chunk * self.num_stages + stage
        return range(self.parts[v], self.parts[v + 1])

    def forward(self, x: Any, chunk: int = 0) -> Any:
        layers = [self.layers[i] for i in self._chunks[chunk]]
        every = self.activation_checkpoint_interval
        if every <= 0 or not (self.training and torch.is_grad_enabled()):
            return _run(layers, x)
        for start in range(0, len(layers), every):  # each group of layers recomputed in backward
            x = checkpoint(_run, layers[start:start + every], x, use_reentrant=False)
        return x


def _run(layers: list[nn.Module], x: Any) -> Any:
    for layer in layers:
        x = layer(x)
    return x


def _as_module(layer: Any, seed: int | None) -> nn.Module:
    if isinstance(layer, LayerSpec):
        if seed is None:
            return layer.build()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return layer.build()
    if isinstance(layer, nn.Module):
        return layer
    if callable(layer):
        return _Fn(layer)
    raise TypeError(f"a pipeline layer must be a module, a LayerSpec or a callable, got {type(layer).__name__}")


def _env_stage(num_stages: int) -> int:
    """This rank's stage from torchrun's environment (pipeline stages are the outermost
    coordinate of the mesh: rank // (world / num_stages))."""
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world % num_stages:
        raise ValueError(f"num_stages {num_stages} does not divide the world size {world}")
    return rank // (world // num_stages)
