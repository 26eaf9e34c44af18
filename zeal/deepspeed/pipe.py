"""``deepspeed.pipe``: ``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec`` with DeepSpeed's signatures.

``PipelineModule(layers, num_stages=2, loss_fn=...)`` is zeal's pipeline module
(:mod:`zeal.pipe.module`) built with DeepSpeed's argument order. Given to
``deepspeed.initialize`` with a config that has no ``pipeline_parallel`` section,
``num_stages`` is the pipeline size (the other ranks are data parallel), as in DeepSpeed;
the engine then trains with ``train_batch(data_iter)`` / ``eval_batch(data_iter)``.

``TiedLayerSpec(key, cls, ...)``: layers with the same key share one module (the first
builds it; the later ones run it, through ``forward_fn(module, x)`` when given). zeal
ties layers within one stage; a key spanning stages (an embedding tied to the head on
another stage) is refused at construction, naming the key.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from zeal.pipe.module import LayerSpec
from zeal.pipe.module import PipelineModule as _ZealPipelineModule

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]


class TiedLayerSpec(LayerSpec):
    """A layer whose module is shared by every ``TiedLayerSpec`` with the same ``key``."""

    def __init__(self, key: str, typename: Callable[..., nn.Module], *module_args: Any,
                 forward_fn: Callable[[nn.Module, Any], Any] | None = None,
                 tied_weight_attr: str | Sequence[str] = ("weight",), **module_kwargs: Any) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key, self.forward_fn = key, forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


class _TiedUse(nn.Module):
    """A later occurrence of a tied layer: runs the first occurrence's module (held
    outside this module's parameters, so it is counted and updated once)."""

    def __init__(self, key: str, registry: dict[str, nn.Module], forward_fn: Callable | None) -> None:
        super().__init__()
        self.key, self._registry, self.forward_fn = key, registry, forward_fn

    def forward(self, x: Any) -> Any:
        module = self._registry[self.key]
        return self.forward_fn(module, x) if self.forward_fn is not None else module(x)


class PipelineModule(_ZealPipelineModule):
    """DeepSpeed's ``PipelineModule(layers, num_stages, topology, loss_fn, seed_layers,
    seed_fn, base_seed, partition_method, activation_checkpoint_interval,
    activation_checkpoint_func, checkpointable_layers, dynamic_shape)``.

    ``partition_method`` is ``parameters`` or ``uniform`` (``type:...`` is refused);
    ``topology`` and ``seed_fn`` are refused (give ``num_stages``; ``seed_layers`` seeds
    each layer with ``base_seed + index``). ``activation_checkpoint_func``,
    ``checkpointable_layers`` and ``dynamic_shape`` are accepted: zeal recomputes with
    torch's non-reentrant checkpoint and sends each activation's shape with it."""

    def __init__(self, layers: Sequence[Any], num_stages: int | None = None, topology: Any = None,
                 loss_fn: Callable | None = None, seed_layers: bool = False, seed_fn: Callable | None = None,
                 base_seed: int = 1234, partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable | None = None, checkpointable_layers: Any = None,
                 dynamic_shape: bool = False) -> None:
        del activation_checkpoint_func, checkpointable_layers, dynamic_shape
        if topology is not None:
            raise ValueError("PipelineModule(topology=...) is not supported by zeal: give num_stages (the other "
                             "ranks are data parallel)")
        if num_stages is None:
            raise ValueError("PipelineModule needs num_stages")
        if seed_fn is not None:
            raise ValueError("PipelineModule(seed_fn=...) is not supported by zeal: seed_layers=True seeds layer i "
                             "with base_seed + i")
        if partition_method.lower().startswith("type:"):
            raise ValueError(f"PipelineModule(partition_method={partition_method!r}): zeal partitions by "
                             "'parameters' or 'uniform'")
        registry: dict[str, nn.Module] = {}
        first: dict[str, int] = {}
        where: dict[str, list[int]] = {}
        built: list[Any] = []
        for i, layer in enumerate(layers):
            if isinstance(layer, TiedLayerSpec):
                where.setdefault(layer.key, []).append(i)
                if layer.key in first:
                    built.append(_TiedUse(layer.key, registry, layer.forward_fn))
                    continue
                first[layer.key] = i
                if layer.forward_fn is not None:  # the first occurrence runs through forward_fn too
                    built.append(LayerSpec(_TiedFirst, layer))
                    continue
            built.append(layer)
        super().__init__(built, loss_fn=loss_fn, num_stages=num_stages, partition_method=partition_method,
                         seed_layers=seed_layers, base_seed=base_seed,
                         activation_checkpoint_interval=activation_checkpoint_interval)
        for key, idx in where.items():
            stages = sorted({self._stage_of(i) for i in idx})
            if len(stages) > 1:
                raise ValueError(f"TiedLayerSpec {key!r} spans pipeline stages {stages}: zeal ties layers within one "
                                 "stage; keep tied layers on one stage (partition_method, num_stages) or untie them")
            owner = self.layers[first[key]]
            if self._stage_of(first[key]) == self.stage_id:
                registry[key] = owner.module if isinstance(owner, _TiedFirst) else owner

    def _stage_of(self, index: int) -> int:
        parts = self.parts
        for v in range(len(parts) - 1):
            if parts[v] <= index < parts[v + 1]:
                return v % self.num_stages
        raise IndexError(index)

    def topology(self) -> None:
        """zeal has no process topology object (the mesh lives in the engine)."""
        return None


class _TiedFirst(nn.Module):
    """The first occurrence of a tied layer with ``forward_fn``: owns the module."""

    def __init__(self, spec: TiedLayerSpec) -> None:
        super().__init__()
        self.module = spec.build()
        self.forward_fn = spec.forward_fn

    def forward(self, x: Any) -> Any:
        return self.forward_fn(self.module, x)
