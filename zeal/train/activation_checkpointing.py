"""The ``activation_checkpointing`` section applied to a model, before precision and ZeRO.

zeal's own models (:class:`~zeal.models.checkpointing.Checkpointable`) get a
:class:`~zeal.models.checkpointing.CheckpointPolicy` built from the section;
Hugging Face models get their own ``gradient_checkpointing_enable()``; anything
else is refused, since zeal cannot know where its blocks are. Checkpointing only
changes what a training forward saves for backward, so it composes with every
ZeRO stage: under stage 3 the recomputation gathers parameters again through the
same module hooks as the forward did.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from zeal.config import ConfigError
from zeal.config.schema import ActivationCheckpointingConfig
from zeal.models.checkpointing import Checkpointable, CheckpointPolicy, blocks_per_checkpoint
from zeal.moe.recompute import comm_aware

log = logging.getLogger("zeal")


def apply_activation_checkpointing(model: nn.Module,
                                   section: ActivationCheckpointingConfig | None) -> CheckpointPolicy | None:
    """Turn on checkpointing in ``model`` as ``section`` says; returns the policy set on
    (the first) zeal model, or None.

    ``section`` None changes nothing (a zeal model's own ``checkpoint_activations``
    flag still applies, with one checkpoint per block). The model itself or, failing
    that, its outermost checkpointable submodules are the targets: a zeal model gets
    ``every = ceil(n_layer / number_checkpoints)``, ``cpu_checkpointing``, ``communication_aware`` and
    ``profile``; a Hugging Face model checkpoints every layer, non-reentrant, with
    ``cpu_checkpointing`` where its transformers version can offload
    (``number_checkpoints`` and ``profile`` are zeal-only and logged as such).
    Raises ConfigError for a model with neither."""
    if section is None:
        return None
    targets = _targets(model)
    if not targets:
        raise ConfigError(
            f"config key 'activation_checkpointing': zeal cannot checkpoint a {type(model).__name__} (neither "
            "a zeal model nor one with gradient_checkpointing_enable()): call torch.utils.checkpoint in the "
            "model itself and drop this section, or expose gradient_checkpointing_enable()")
    first: CheckpointPolicy | None = None
    for t in targets:
        if isinstance(t, Checkpointable):
            old = t.checkpoint_policy
            policy = policy_from_section(section, len(t.layer_stack()), old.use_reentrant)
            # keep what other apply-steps injected (recompute wrappers, the loss)
            policy.recompute = (*old.recompute, *(w for w in policy.recompute if w not in old.recompute))
            policy.logits_loss = old.logits_loss
            t.checkpoint_policy = policy
            first = first or policy
        else:
            _enable_hf(t, section)
    return first


def policy_from_section(section: ActivationCheckpointingConfig, n_blocks: int,
                        use_reentrant: bool = False) -> CheckpointPolicy:
    """The enabled policy for a stack of ``n_blocks`` blocks."""
    return CheckpointPolicy(enabled=True, every=blocks_per_checkpoint(n_blocks, section.number_checkpoints),
                            cpu_checkpointing=section.cpu_checkpointing, profile=section.profile,
                            use_reentrant=use_reentrant,
                            recompute=(comm_aware,) if section.communication_aware else ())  # MoE all-to-alls reused


def _is_hf(module: nn.Module) -> bool:
    return hasattr(module, "supports_gradient_checkpointing") and (
        hasattr(module, "activation_checkpointing_enable") or hasattr(module, "gradient_checkpointing_enable"))


def _targets(module: nn.Module) -> list[nn.Module]:
    if isinstance(module, Checkpointable) or _is_hf(module):
        return [module]
    return [t for child in module.children() for t in _targets(child)]


def _enable_hf(model: nn.Module, section: ActivationCheckpointingConfig) -> None:
    """Every layer, non-reentrant. transformers >= 5.x names the method
    ``activation_checkpointing_enable`` (the old name warns) and can offload the
    checkpointed inputs to pinned host memory, which is ``cpu_checkpointing``."""
    if not model.supports_gradient_checkpointing:
        raise ConfigError(f"config key 'activation_checkpointing': {type(model).__name__} does not support "
                          "gradient checkpointing (supports_gradient_checkpointing is False)")
    from zeal.parallel.rng import checkpoint_context

    kwargs = {"use_reentrant": False, "context_fn": checkpoint_context}  # recompute replays the tp RNG streams
    zeal_only = [k for k in ("profile", "communication_aware") if getattr(section, k)]
    if section.number_checkpoints is not None:
        zeal_only.append("number_checkpoints")
    if hasattr(model, "activation_checkpointing_enable"):
        offload = section.cpu_checkpointing and torch.cuda.is_available()
        if section.cpu_checkpointing and not offload:
            log.info("activation_checkpointing.cpu_checkpointing: the activations are already in CPU memory; "
                     "no effect on a CPU device")
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, offload=offload)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if section.cpu_checkpointing:
            zeal_only.insert(0, "cpu_checkpointing")
    if zeal_only:
        log.info("activation_checkpointing.%s: applies to zeal's own models only; %s checkpoints every layer",
                 ", ".join(zeal_only), type(model).__name__)
