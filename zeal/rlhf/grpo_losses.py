"""The GRPO loss family as pure functions of per-token tensors (fp32), with TRL's names and
normalisations, and the truncated importance-sampling weights that correct the gap between
the generator's and the trainer's log-probabilities.

Shapes follow :mod:`zeal.rlhf.formulas`: ``(B, T)`` per-token tensors over the answer
positions, ``mask`` 1 on the tokens that count in the loss (answer tokens the policy
produced; 0 on padding, on tool outputs of a multi-turn episode, on masked truncated
answers), advantages ``(B,)`` one per answer (or ``(B, T)``).

The loss types (``loss_type``), all over the per-token term ``ℓ`` below:

* ``grpo``: mean of ``ℓ`` over each answer's tokens, then over answers (the DeepSeekMath paper;
  favours short right answers and long wrong ones).
* ``bnpo``: mean of ``ℓ`` over all tokens of the micro-batch.
* ``dr_grpo``: sum of ``ℓ`` over all tokens / (answers × ``max_completion_length``): no length
  bias, a constant normaliser (Dr. GRPO).
* ``dapo``: sum of ``ℓ`` / ``num_items``, the count of loss tokens of the whole optimizer batch
  (all micro-batches and ranks; TRL's default).
* ``gspo``: a sequence-level ratio ``s_i = exp(mean_t(logπ − logπ_old))`` clipped per answer,
  aggregated as ``grpo`` (the GSPO paper; ``importance_sampling_level="sequence"``).
* ``cispo``: ``ℓ = −sg(min(ratio, ε_high))·A·logπ``, the clipped ratio as a stop-gradient weight
  on REINFORCE (MiniMax-M1 / ScaleRL), normalised as ``dapo``.

The PPO-style term (every type but cispo) is ``ℓ = −min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A)``
with ``r`` per token (``importance_sampling_level="token"``) or per answer (``"sequence"``); the
mismatch weights ``w`` multiply it, then ``β·k3`` (the KL to the reference) is added.
"""

from __future__ import annotations

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "gspo", "cispo")
#: zeal's earlier names: 'sequence' was the paper's GRPO mean, 'token' the token mean of BNPO
ALIASES = {"sequence": "grpo", "token": "bnpo"}
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def canonical_loss_type(name: str) -> str:
    """The loss type ``name`` stands for (accepting zeal's earlier 'sequence' / 'token')."""
    name = ALIASES.get(name, name)
    if name not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {name!r}")
    return name


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each position's next-token distribution, ``(..., V) → (...)``, fp32, no grad."""
    with torch.no_grad():
        lp = torch.log_softmax(logits.detach().float(), dim=-1)
        return -(lp.exp() * lp).sum(-1)


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """1 on the loss tokens whose entropy is at least the ``1 − quantile`` quantile of the
    masked entropies ("Beyond the 80/20 rule": keep the top-ρ forking tokens; ``quantile``
    1 keeps every token, 0 only the highest)."""
    vals = entropy[mask.bool()].float()
    if vals.numel() == 0:
        return torch.zeros_like(mask)
    threshold = torch.quantile(vals, 1.0 - quantile)
    return ((entropy >= threshold) & mask.bool()).to(mask.dtype)


def mismatch_weights(trainer_logprobs: torch.Tensor, generator_logprobs: torch.Tensor, mask: torch.Tensor,
                     mode: str = "token_truncate", clip_max: float | None = 3.0,
                     clip_min: float | None = None) -> torch.Tensor:
    """Importance weights for the rollout/trainer mismatch: ``ρ = exp(logπ_train − logπ_gen)``
    per token (``token_*``: ``(B, T)``) or per answer (``sequence_*``: the exponent summed over
    the answer's tokens, ``(B, 1)``); ``*_truncate`` clamps ρ into ``[clip_min, clip_max]``
    (truncated importance sampling), ``*_mask`` sets the weights outside it to 0. Outside
    ``mask`` the exponent is 0. No gradient flows (both inputs are behaviour-side constants)."""
    if mode not in IS_MODES:
        raise ValueError(f"importance_sampling_mode must be one of {', '.join(IS_MODES)}, got {mode!r}")
    diff = (trainer_logprobs.detach() - generator_logprobs.detach()) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    rho = torch.exp(diff)
    if mode.endswith("truncate"):
        return rho.clamp(min=clip_min, max=clip_max) if (clip_min, clip_max) != (None, None) else rho
    lo = -float("inf") if clip_min is None else clip_min
    hi = float("inf") if clip_max is None else clip_max
    return rho.masked_fill((rho < lo) | (rho > hi), 0.0)


def _seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] == 1 and mask.shape[-1] != 1:  # one value per answer
        return x.float().mean()
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                *, loss_type: str = "dapo", importance_sampling_level: str = "token", eps_low: float = 0.2,
                eps_high: float | None = None, ref_logprobs: torch.Tensor | None = None, beta: float = 0.0,
                is_weights: torch.Tensor | None = None, max_completion_length: int | None = None,
                num_items: float | torch.Tensor | None = None, entropy_mask: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """One of the :data:`LOSS_TYPES` over a micro-batch (see the module docstring) and its
    metrics (``clip_ratio_{low,high,region}`` — the share of loss tokens whose ratio is
    clipped where the advantage pushes it out of the range —, ``cispo_clip_ratio``, ``kl``).
    ``eps_high`` defaults to ``eps_low`` (cispo: it is ε_max, e.g. 5.0, and required);
    ``max_completion_length`` is dr_grpo's normaliser (default: the mask's width);
    ``num_items`` dapo/cispo's (default: this micro-batch's loss tokens); ``is_weights``
    from :func:`mismatch_weights`; ``entropy_mask`` from :func:`high_entropy_mask`."""
    loss_type = canonical_loss_type(loss_type)
    if loss_type == "gspo":
        importance_sampling_level = "sequence"
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {importance_sampling_level!r}")
    mask = mask.to(logprobs.dtype)
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    hi = eps_low if eps_high is None else eps_high
    log_ratio = logprobs - old_logprobs
    if importance_sampling_level == "sequence":
        log_ratio = _seq_mean(log_ratio, mask).unsqueeze(-1)  # (B, 1)
    ratio = torch.exp(log_ratio)
    metrics: dict[str, float] = {}
    if loss_type == "cispo":
        if eps_high is None:
            raise ValueError("loss_type 'cispo' needs eps_high (its ε_max; ScaleRL uses 5.0)")
        per_tok = -ratio.clamp(max=hi).detach() * adv * logprobs
        metrics["cispo_clip_ratio"] = float(_masked_mean(((ratio > hi) & (adv > 0)).float(), mask))
    else:
        clipped = ratio.clamp(1.0 - eps_low, 1.0 + hi)
        per_tok = -torch.minimum(ratio * adv, clipped * adv)
        low = ((ratio < 1.0 - eps_low) & (adv < 0)).float()
        high = ((ratio > 1.0 + hi) & (adv > 0)).float()
        metrics["clip_ratio_low"] = float(_masked_mean(low, mask))
        metrics["clip_ratio_high"] = float(_masked_mean(high, mask))
        metrics["clip_ratio_region"] = float(_masked_mean(torch.maximum(low, high), mask))
    if entropy_mask is not None:
        per_tok = per_tok * entropy_mask
    if is_weights is not None:
        per_tok = per_tok * is_weights
    if ref_logprobs is not None and beta:
        d = ref_logprobs - logprobs
        kl = torch.exp(d) - d - 1.0
        per_tok = per_tok + beta * kl
        metrics["kl"] = float(_masked_mean(kl.detach(), mask))
    if loss_type in ("grpo", "gspo"):
        loss = _seq_mean(per_tok, mask).mean()
    elif loss_type == "bnpo":
        loss = (per_tok * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        width = mask.shape[-1] if max_completion_length is None else max_completion_length
        loss = (per_tok * mask).sum() / (per_tok.shape[0] * width)
    else:  # dapo, cispo
        n = mask.sum() if num_items is None else torch.as_tensor(num_items, dtype=mask.dtype)
        loss = (per_tok * mask).sum() / n.clamp(min=1.0)
    return loss, metrics
