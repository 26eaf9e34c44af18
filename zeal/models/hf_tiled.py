"""ALST's tiled logits loss for Hugging Face causal LMs, whose own forward projects every
hidden state to whole ``[tokens, vocab]`` logits before its loss.

With ``tiling.tiled_logits_loss`` on, :class:`HFTiledLoss` runs in place of
``model(input_ids=..., labels=...)``: it calls the base model (``model.model``, the
decoder stack without the head) for the last hidden states and scores them with
:func:`zeal.models.tiled.tiled_logits_loss` over ``lm_head``, so the logits exist one tile
at a time in forward and in backward. The labels are treated as transformers'
``ForCausalLMLoss`` treats them: shifted left by one inside (or given already shifted as
``shift_labels``), ``-100`` ignored, the sum divided by ``num_items_in_batch`` when the
caller passes it (the Trainer's gradient-accumulation normalisation), else by the count
of scored tokens. The returned output is the model's output type with ``loss`` set and
``logits`` None. Calls without labels (generation, evaluation of logits) run the model
as it is.

A model whose logits are not the plain head projection (a config with
``final_logit_softcapping``, ``logit_scale`` or ``logits_scaling``) or that is not a
``...ForCausalLM`` keeps its own loss (:func:`hf_lm_parts` says why).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zeal.models.tiled import NumShards, tiled_logits_loss

IGNORE = -100
_SCALED_LOGITS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def hf_lm_parts(model: nn.Module) -> tuple[nn.Module, nn.Module] | str:
    """``(base model, head)`` of a Hugging Face causal LM whose logits are ``head(hidden)``,
    or a sentence saying why the tiled loss cannot replace its own."""
    name = type(model).__name__
    if not name.endswith("ForCausalLM"):
        return f"{name} is not a ...ForCausalLM"
    cfg = getattr(model, "config", None)
    for key in _SCALED_LOGITS:
        if getattr(cfg, key, None) not in (None, 1, 1.0):
            return f"{name}'s logits are scaled ({key})"
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(base, nn.Module) or not isinstance(head, nn.Linear):
        return f"{name} has no base model and Linear head zeal can find"
    return base, head


def head_params(head: nn.Module) -> list[torch.Tensor]:
    """What the head's projection reads and trains: its parameters, or (a pipeline's
    tied copy) the tensors in its ``weight``/``bias`` slots that require grad."""
    params = [p for p in head.parameters() if p.requires_grad]
    if params:
        return params
    slots = (getattr(head, "weight", None), getattr(head, "bias", None))
    return [t for t in slots if isinstance(t, torch.Tensor) and t.requires_grad]


def shift_targets(labels: torch.Tensor) -> torch.Tensor:
    """Next-token targets of ``labels`` (B, T): ``labels[:, 1:]`` and one ``-100`` at the end."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE)


class HFTiledLoss:
    """``runner(*args, **kwargs)`` = ``model(*args, **kwargs)`` for a Hugging Face causal LM,
    its loss taken by the tiled logits loss when labels are given (see the module docstring)."""

    def __init__(self, model: nn.Module, base: nn.Module, head: nn.Module, num_shards: NumShards) -> None:
        self.model, self.base, self.head, self.num_shards = model, base, head, num_shards
        self.hold_params = None  # ZeRO-3's holding context (zeal.train.tiling.attach_to_zero)
        self._signature = inspect.signature(model.forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        a = dict(self._signature.bind_partial(*args, **kwargs).arguments)
        extra = a.pop("kwargs", None)
        if isinstance(extra, dict):
            a.update(extra)
        labels, shift = a.pop("labels", None), a.pop("shift_labels", None)
        if labels is None and shift is None:
            return self.model(*args, **kwargs)
        items = a.pop("num_items_in_batch", None)
        if a.get("return_dict") is False:
            raise ValueError("the tiled logits loss returns an output object: drop return_dict=False")
        a.pop("return_dict", None)
        a.pop("logits_to_keep", None)
        a.setdefault("use_cache", False)
        out = self.base(**a)
        y = shift if shift is not None else shift_targets(labels)
        total, count = tiled_logits_loss(self.head, out.last_hidden_state, y, self.num_shards,
                                         params=head_params(self.head), ignore_index=IGNORE,
                                         hold=self.hold_params)
        denom = items if items is not None else count.clamp(min=1)
        loss = total / (denom.to(total.device) if isinstance(denom, torch.Tensor) else denom)
        return _output(loss, out)


def _output(loss: torch.Tensor, out: Any) -> Any:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=getattr(out, "past_key_values", None),
                                  hidden_states=getattr(out, "hidden_states", None),
                                  attentions=getattr(out, "attentions", None))


def hf_tiled_loss(model: nn.Module, num_shards: NumShards) -> HFTiledLoss | str:
    """The runner for ``model``, or why its own loss stays (see :func:`hf_lm_parts`)."""
    parts = hf_lm_parts(model)
    if isinstance(parts, str):
        return parts
    return HFTiledLoss(model, *parts, num_shards)
