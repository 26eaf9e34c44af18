"""The ``tiling`` section applied to a model: ALST's TiledMLP and tiled logits loss.

``apply_tiling`` runs after tensor parallelism and MoE (it wraps the modules they
leave) and before ZeRO (the wrapper registers the same parameters under the same
names, so ZeRO's units and checkpoints see no difference):

* TiledMLP: every dense decoder MLP (a child named ``mlp`` holding ``gate_proj``/
  ``up_proj``/``down_proj``, or ``c_fc``/``c_proj``: zeal's GPT and Llama, Hugging Face
  Llama, Qwen2, Mistral, GPT-2 ...) is wrapped in :class:`zeal.models.tiled.TiledMLP`.
  An MoE layer is left alone (its routing capacity depends on the tokens of the call).
* tiled logits loss: zeal's GPT and Llama score their loss with
  :func:`zeal.models.tiled.tiled_logits_loss`; a Hugging Face causal LM (whose forward
  projects whole logits) is run by :class:`zeal.models.hf_tiled.HFTiledLoss` instead of
  its forward, and the sequence-parallel runner tiles its chunk's loss
  (:func:`tiled_loss_runner`).

Under ZeRO-3, :func:`attach_to_zero` makes each TiledMLP hold its MLP's units for the
whole call: they are gathered once per MLP forward and once per MLP backward, not per
tile (the per-tile calls of the inner linears find them gathered).
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from zeal.config.tiling import TilingConfig
from zeal.models.checkpointing import Checkpointable
from zeal.models.hf_tiled import hf_tiled_loss
from zeal.models.tiled import TiledMLP

log = logging.getLogger("zeal")

_DENSE_MLP_CHILDREN = ({"gate_proj", "up_proj", "down_proj"}, {"c_fc", "c_proj"})


def is_dense_mlp(module: nn.Module) -> bool:
    """A row-wise feed-forward block zeal knows how to tile (not an MoE layer)."""
    names = {n for n, _ in module.named_children()}
    return not isinstance(module, TiledMLP) and any(need <= names for need in _DENSE_MLP_CHILDREN) and \
        "experts" not in names and "gate" not in names


def apply_tiling(model: nn.Module, section: TilingConfig | None) -> list[TiledMLP]:
    """Wrap the dense MLPs and switch on the tiled loss as ``section`` says; returns the
    TiledMLP wrappers (for :func:`attach_to_zero`)."""
    if section is None:
        return []
    wrapped: list[TiledMLP] = []
    if section.tiled_mlp.enabled:
        hidden = _hidden_size(model)
        for parent in list(model.modules()):
            child = getattr(parent, "mlp", None)
            if isinstance(child, nn.Module) and "mlp" in dict(parent.named_children()) and is_dense_mlp(child):
                w = TiledMLP(child, section.tiled_mlp.num_shards, hidden)
                parent.mlp = w
                wrapped.append(w)
        if not wrapped:
            log.warning("tiling.tiled_mlp: %s has no dense MLP zeal can tile (a child named 'mlp' with "
                        "gate_proj/up_proj/down_proj or c_fc/c_proj); nothing tiled", type(model).__name__)
    if section.tiled_logits_loss.enabled:
        targets = [m for m in model.modules() if isinstance(m, Checkpointable)]
        for m in targets:
            m.checkpoint_policy.loss_shards = section.tiled_logits_loss.num_shards
    return wrapped


def tiled_loss_runner(model: nn.Module, section: TilingConfig | None, sp: Any) -> Any:
    """What the engine runs in place of ``model(...)`` (``sp``: the sequence-parallel runner
    or None): under ``tiled_logits_loss``, ``sp`` takes its loss over tiles, and a Hugging
    Face causal LM without sp is run by :class:`zeal.models.hf_tiled.HFTiledLoss` (zeal's
    own models tile inside, :func:`apply_tiling`)."""
    if section is None or not section.tiled_logits_loss.enabled:
        return sp
    shards = section.tiled_logits_loss.num_shards
    if sp is not None:
        sp.loss_shards = shards
        return sp
    if any(isinstance(m, Checkpointable) for m in model.modules()):
        return None
    runner = hf_tiled_loss(model, shards)
    if isinstance(runner, str):
        log.warning("tiling.tiled_logits_loss does not apply: %s; the model computes its own loss from whole "
                    "logits", runner)
        return None
    return runner


def attach_to_zero(wrapped: list[TiledMLP], coordinator: object | None, model: nn.Module | None = None,
                   runner: Any = None) -> None:
    """Under ZeRO-3, gather each TiledMLP's parameters around the whole wrapper call
    (the parameters as ZeRO materialised them: read after ``apply_zero``), and give the tiled
    loss of ``model`` (its checkpoint policy) and of ``runner`` (the sequence-parallel or Hugging
    Face loss runner) the coordinator's ``holding``: the head is gathered once for the tile
    loop, in forward and in backward, not around every tile."""
    if coordinator is None:
        return
    for w in wrapped:
        for p in w.parameters():
            coordinator.add_external(w, p)
    hold = getattr(coordinator, "holding", None)
    for target in [m.checkpoint_policy for m in (model.modules() if model is not None else ())
                   if isinstance(m, Checkpointable)] + ([runner] if runner is not None else []):
        if hasattr(target, "hold_params"):
            target.hold_params = hold


def _hidden_size(model: nn.Module) -> int | None:
    cfg = getattr(model, "config", None)
    for name in ("hidden_size", "n_embd", "d_model"):
        v = getattr(cfg, name, None)
        if isinstance(v, int):
            return v
    return None
