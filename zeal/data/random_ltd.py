"""random-LTD: random layerwise token dropping (DeepSpeed's ``data_routing.random_ltd``).

In a training forward, each chosen layer runs on a random subset of ``r`` of the ``T``
tokens of every sample (drawn per layer and per sample, uniformly without replacement,
sorted ascending); the other tokens bypass the layer unchanged, and the layer's outputs
are scattered back to their positions, so the next layer sees the full length again.

* Autograd: :func:`gather_tokens` / :func:`scatter_tokens` are ``gather`` and an
  out-of-place ``scatter``: the gradient of a dropped token flows through the bypass as
  the identity; a kept token's gradient is the layer's Jacobian (``gradcheck`` in tests).
* Causal mask: indices are sorted, so ``idx_i >= idx_j ⇔ i >= j`` and the causal mask of
  the kept tokens is the leading ``r×r`` block: zeal's layers (``is_causal``) need nothing;
  a Hugging Face 4-D mask is gathered by rows and columns (padding stays correct).
* Positions: what a layer receives per token (zeal Llama's ``Rope``, Hugging Face's
  ``position_embeddings`` / ``position_ids``) is gathered with the tokens, so a kept token
  keeps its original position. zeal's GPT adds positions before the layers.
* Recomputation: indices are drawn from torch's global generator on the activations'
  device, whose state activation checkpointing restores before recomputing (as for
  dropout), so a recomputed layer draws the same indices as its original forward.
* Eval mode, and ``r >= T``, call the layer exactly as without random-LTD (bit-identical).

The layer keeps its parameter names (its ``forward`` is replaced on the instance), so
checkpoints and exports are those of the plain model.

DeepSpeed's names: :func:`convert_to_random_ltd` (which modules are the layers),
:func:`save_without_random_ltd` / :func:`remove_random_ltd_state_dict`, and the engine's
``random_ltd_scheduler`` (this module's :class:`TokenDrop`: ``state``,
``get_current_seq()``) — also importable from ``zeal.deepspeed.runtime.data_pipeline``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


def kept_tokens(step: int, min_value: int, max_value: int, require_steps: int, seq_per_step: int) -> int:
    """DeepSpeed's fixed_linear kept-token count: ``min(L, f − f mod s)``,
    ``f = floor(t / T_r · (L − r0) + r0)``."""
    f = math.floor(float(step) / require_steps * (max_value - min_value) + min_value)
    f -= f % seq_per_step
    return int(min(max_value, f))


def gather_tokens(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x (B, T, ...)`` at ``idx (B, r)`` along dim 1 → ``(B, r, ...)``."""
    return torch.gather(x, 1, _expand(idx, x))


def scatter_tokens(full: torch.Tensor, part: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """A copy of ``full (B, T, ...)`` with ``part (B, r, ...)`` written at ``idx (B, r)``."""
    return full.scatter(1, _expand(idx, full), part.to(full.dtype))


def _expand(idx: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    shape = (idx.shape[0], idx.shape[1], *like.shape[2:])
    return idx.view(*idx.shape, *([1] * (like.dim() - 2))).expand(shape)


def draw_indices(batch: int, seq: int, kept: int, device: torch.device) -> torch.Tensor:
    """``(batch, kept)`` sorted positions, a uniform ``kept``-subset of ``range(seq)`` per row
    (torch's global generator on ``device``: what checkpoint recomputation restores)."""
    keys = torch.rand(batch, seq, device=device)
    return keys.topk(kept, dim=1).indices.sort(dim=1).values


@dataclass
class TokenDrop:
    """random-LTD applied to a model: which layers, the kept-token schedule, and its state.
    ``kept`` is the current count (None: no dropping yet, e.g. before the first step);
    ``record``: when a list, every drawn index tensor is appended (tests, debugging)."""

    layer_ids: list[int]
    total_layers: int
    min_value: int
    max_value: int
    require_steps: int
    seq_per_step: int
    kept: int | None = None
    step: int = 0
    record: list | None = None
    consumed_layer_tokens: int = 0
    dp_size: int = 1
    _restore: list = field(default_factory=list, repr=False)
    _shape: tuple[int, int] | None = field(default=None, repr=False)

    def update(self, step: int) -> int:
        """The kept count at global step ``step`` (recomputed while below ``max_value``)."""
        self.step = int(step)
        if self.kept is None or self.kept < self.max_value:
            self.kept = kept_tokens(step, self.min_value, self.max_value, self.require_steps, self.seq_per_step)
        return self.kept

    def layer_tokens(self, samples: int, seq: int) -> int:
        """Layer-tokens of ``samples`` samples of ``seq`` tokens at the current count:
        ``samples · (r · n_ltd + T · (n_l − n_ltd))``."""
        r = min(seq, self.kept if self.kept is not None else seq)
        n = len(self.layer_ids)
        return samples * (r * n + seq * (self.total_layers - n))

    def effective_seq_len(self, seq: int) -> int:
        """Megatron-DeepSpeed's ``(T · (n_l − n_ltd) + r · n_ltd) // n_l``."""
        return self.layer_tokens(1, seq) // self.total_layers

    @property
    def state(self) -> dict[str, int]:
        """DeepSpeed's scheduler state: ``consumed_layer_tokens`` (over all data-parallel
        ranks), ``current_value`` (kept tokens), ``min_value``, ``max_value``."""
        return {"consumed_layer_tokens": self.consumed_layer_tokens, "current_value": self.get_current_seq(),
                "min_value": self.min_value, "max_value": self.max_value}

    def get_current_seq(self) -> int:
        """The kept-token count of the current step (DeepSpeed's name)."""
        return self.kept if self.kept is not None else self.max_value

    # the step hooks: a micro-batch's layer-tokens are counted once (not again when a
    # checkpointed layer recomputes); the schedule advances after every optimizer step
    def before_backward(self, boundary: bool) -> None:
        if self._shape is not None:
            self.consumed_layer_tokens += self.layer_tokens(*self._shape) * self.dp_size
            self._shape = None

    def after_step(self, applied: bool) -> None:
        self.update(self.step + 1)

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "kept": -1 if self.kept is None else self.kept,
                "consumed_layer_tokens": self.consumed_layer_tokens}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.step, self.consumed_layer_tokens = int(sd["step"]), int(sd.get("consumed_layer_tokens", 0))
        self.kept = None if int(sd["kept"]) < 0 else int(sd["kept"])

    def remove(self) -> None:
        """Give every wrapped layer its own forward back."""
        for layer in self._restore:
            layer.__dict__.pop("forward", None)
        self._restore.clear()


class _DroppingForward:
    """The forward a wrapped layer gets: see the module docstring."""

    def __init__(self, layer: nn.Module, forward: Callable[..., Any], drop: TokenDrop, mask_name: str,
                 seq_first: bool) -> None:
        self.layer, self.forward, self.drop = layer, forward, drop
        self.mask_name, self.seq_first = mask_name, seq_first

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        r = self.drop.kept
        if not self.layer.training or x.dim() < 3:
            return self.forward(x, *args, **kwargs)
        full = x.transpose(0, 1) if self.seq_first else x
        b, t = full.shape[:2]
        self.drop._shape = (b, t)
        if r is None or r >= t:
            return self.forward(x, *args, **kwargs)
        idx = draw_indices(b, t, r, full.device)
        if self.drop.record is not None:
            self.drop.record.append(idx)
        part = gather_tokens(full, idx)
        args = tuple(_gather_extra(a, idx, b, t) for a in args)
        kwargs = {k: (_gather_mask(v, idx) if k == self.mask_name else _gather_extra(v, idx, b, t))
                  for k, v in kwargs.items()}
        out = self.forward(part.transpose(0, 1) if self.seq_first else part, *args, **kwargs)
        first = out[0] if isinstance(out, tuple) else out
        if self.seq_first:
            first = first.transpose(0, 1)
        merged = scatter_tokens(full, first, idx)
        if self.seq_first:
            merged = merged.transpose(0, 1)
        return (merged, *out[1:]) if isinstance(out, tuple) else merged


def _gather_extra(v: Any, idx: torch.Tensor, b: int, t: int) -> Any:
    """Per-token inputs follow their tokens: a tensor (or tuple of tensors, e.g. cos/sin)
    whose leading dims are ``(T, ...)`` or ``(B|1, T, ...)``; anything else is passed as is."""
    if isinstance(v, tuple) and v and all(isinstance(e, torch.Tensor) for e in v):
        out = [_gather_extra(e, idx, b, t) for e in v]
        return type(v)(*out) if hasattr(v, "_fields") else tuple(out)
    if not isinstance(v, torch.Tensor) or v.dim() == 0:
        return v
    if v.dim() >= 2 and v.shape[1] == t and v.shape[0] in (1, b):
        return gather_tokens(v.expand(b, *v.shape[1:]), idx)
    if v.dim() >= 2 and v.shape[0] == t:  # (T, ...): shared by every sample
        return v[idx]
    return v


def _gather_mask(mask: Any, idx: torch.Tensor) -> Any:
    """A 4-D attention mask ``(B|1, H|1, T, T)``: rows and columns of the kept tokens."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return mask
    b = idx.shape[0]
    m = mask.expand(b, *mask.shape[1:])
    rows = torch.gather(m, 2, idx[:, None, :, None].expand(b, m.shape[1], idx.shape[1], m.shape[3]))
    return torch.gather(rows, 3, idx[:, None, None, :].expand(b, m.shape[1], idx.shape[1], idx.shape[1]))


def layer_stack(model: nn.Module) -> Sequence[nn.Module]:
    """The decoder layers: a zeal model's ``layer_stack()``, or a Hugging Face model's
    ``model.layers`` (Llama family) / ``transformer.h`` (GPT-2 family)."""
    if "_random_ltd_layers" in model.__dict__:  # convert_to_random_ltd (kept out of the state dict)
        return model.__dict__["_random_ltd_layers"]
    if callable(getattr(model, "layer_stack", None)):
        return model.layer_stack()
    for path in ("model.layers", "transformer.h", "model.decoder.layers", "layers", "h"):
        node: Any = model
        for part in path.split("."):
            node = getattr(node, part, None)
        if isinstance(node, nn.ModuleList):
            return node
    raise ValueError(f"random_ltd: cannot find the decoder layers of {type(model).__name__} "
                     "(expected layer_stack(), model.layers or transformer.h; or name their class with "
                     "convert_to_random_ltd(model, LayerClass) before initialize)")


def apply_token_drop(model: nn.Module, cfg: Any, dp_size: int = 1) -> TokenDrop | None:
    """Wrap the layers ``data_efficiency.data_routing.random_ltd`` names (``cfg`` a
    :class:`~zeal.config.Config` or the ``random_ltd`` section); None when it is off.
    ``dp_size``: the data-parallel ranks whose layer-tokens the consumed count adds up."""
    rl = cfg.data_efficiency.random_ltd() if hasattr(cfg, "data_efficiency") else cfg
    if rl is None or not rl.enabled:
        return None
    layers = layer_stack(model)
    n = len(layers)
    if rl.total_layer_num is not None and rl.total_layer_num != n:
        raise ValueError(f"data_efficiency.data_routing.random_ltd.total_layer_num {rl.total_layer_num} != "
                         f"the model's {n} layers")
    ids = list(rl.random_ltd_layer_id) if rl.random_ltd_layer_id is not None else list(range(1, n - 1))
    if rl.random_ltd_layer_num is not None and rl.random_ltd_layer_id is None:
        ids = ids[: rl.random_ltd_layer_num]
    bad = [i for i in ids if i >= n]
    if bad:
        raise ValueError(f"data_efficiency.data_routing.random_ltd.random_ltd_layer_id {bad[0]}: the model has "
                         f"{n} layers")
    s = rl.random_ltd_schedule
    drop = TokenDrop(sorted(ids), n, s.min_value, s.max_value, s.schedule_config["require_steps"],
                     s.schedule_config["seq_per_step"], dp_size=dp_size)
    drop.update(0)
    for i in drop.layer_ids:
        layer = layers[i]
        layer.forward = _DroppingForward(layer, layer.forward, drop, rl.model_mask_name,
                                         rl.hidden_state_order == "seq_batch_dim")
        drop._restore.append(layer)
    return drop


def convert_to_random_ltd(model: Any, convert_type: type) -> Any:
    """DeepSpeed's ``convert_to_random_ltd(model, layer_class)``: the modules of type
    ``convert_type`` (in registration order) are the layers random-LTD counts and wraps.

    Before ``initialize``: marks the model, so the ``random_ltd`` config is applied to those
    modules (a model whose layers zeal cannot find needs this). After it (``model`` the
    engine, as DeepSpeed's scripts call it): checks that the engine's random-LTD layers are
    of that type. Returns ``model``."""
    inner = getattr(model, "__dict__", {}).get("engine")  # DeepSpeed's facade keeps zeal's engine there
    engine = inner if hasattr(inner, "token_drop") else model if hasattr(model, "token_drop") else None
    module = engine.module if engine is not None else model
    found = [m for m in module.modules() if isinstance(m, convert_type)]
    if not found:
        raise ValueError(f"convert_to_random_ltd: {type(module).__name__} has no {convert_type.__name__} module")
    if engine is None:
        module.__dict__["_random_ltd_layers"] = tuple(found)  # not a submodule: no new state-dict keys
        return model
    if engine.token_drop is None:
        raise ValueError("convert_to_random_ltd: random-LTD is off in this engine's config "
                         "(data_efficiency.data_routing.random_ltd.enabled)")
    wrapped = [m for m in module.modules() if isinstance(m.__dict__.get("forward"), _DroppingForward)]
    stray = [type(m).__name__ for m in wrapped if not isinstance(m, convert_type)]
    if stray:
        raise ValueError(f"convert_to_random_ltd: the engine's random-LTD layers are {stray[0]}, not "
                         f"{convert_type.__name__}; call convert_to_random_ltd(model, {convert_type.__name__}) "
                         "before initialize")
    return model


def remove_random_ltd_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The plain model's keys (DeepSpeed's name): DeepSpeed's wrapper inserts
    ``random_ltd_layer.`` into its layers' keys, which this removes; zeal's wrapping
    changes no name, so a zeal state dict comes back as it is."""
    return {k.replace(".random_ltd_layer.", "."): v for k, v in state_dict.items()}


def save_without_random_ltd(model: Any) -> dict[str, Any]:
    """The model's state dict as the plain model's (DeepSpeed's name); an engine gives its
    whole gathered model state (every rank must call it then)."""
    if hasattr(model, "module_state_dict"):
        return remove_random_ltd_state_dict(model.module_state_dict())
    return remove_random_ltd_state_dict(model.state_dict())
