"""Rollouts and examples as padded tensors: right padding (the causal models then need no
attention mask and every row keeps positions ``0..``), with the action mask that
:mod:`zeal.rlhf.formulas` reads."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from zeal.rlhf.formulas import token_logprobs


@dataclass
class Packed:
    """``ids (N, T)`` right-padded; ``mask (N, T-1)`` 1 on the actions that choose an answer
    token; ``logprobs (N, T-1)`` the serving engine's log-probs on those actions (0 elsewhere)."""

    ids: torch.Tensor
    mask: torch.Tensor
    logprobs: torch.Tensor

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.mask.sum(-1)


def pack(prompts: list[list[int]], answers: list[list[int]], pad_id: int,
         logprobs: list[list[float]] | None = None, device: torch.device | str = "cpu",
         loss_masks: list[list[int] | None] | None = None) -> Packed:
    """Right-pad ``prompt + answer`` rows into one batch; answer ``i``'s tokens are the
    actions ``[len(prompt_i) − 1, len(prompt_i) − 1 + len(answer_i))``; ``loss_masks[i]``
    (per answer token, None: ones) zeroes the mask on the tokens the policy did not choose."""
    if len(prompts) != len(answers):
        raise ValueError(f"pack: {len(prompts)} prompts for {len(answers)} answers")
    width = max(len(p) + len(a) for p, a in zip(prompts, answers))
    n = len(prompts)
    ids = torch.full((n, max(width, 2)), pad_id, dtype=torch.long)
    mask = torch.zeros(n, ids.shape[1] - 1)
    lps = torch.zeros(n, ids.shape[1] - 1)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        if not p:
            raise ValueError(f"pack: prompt {i} is empty")
        ids[i, : len(p) + len(a)] = torch.tensor(p + a, dtype=torch.long)
        s = len(p) - 1
        lm = loss_masks[i] if loss_masks is not None else None
        mask[i, s : s + len(a)] = 1.0 if lm is None else torch.tensor(lm[: len(a)], dtype=torch.float32)
        if logprobs is not None:
            lps[i, s : s + len(a)] = torch.tensor(logprobs[i][: len(a)], dtype=torch.float32)
    return Packed(ids.to(device), mask.to(device), lps.to(device))


def policy_logprobs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Per-action log-probs of ``ids`` under ``model`` (a module or a TrainEngine returning logits)."""
    return token_logprobs(model(ids), ids)


def projects_positions(model: nn.Module) -> bool:
    """Whether ``model`` (or the module a TrainEngine wraps) takes ``logits_index`` (zeal's
    ``Llama`` and ``GPT``: of a (B, T) batch it picks the positions the LM head projects)."""
    target = getattr(model, "module", model)
    try:
        return "logits_index" in inspect.signature(target.forward).parameters
    except (TypeError, ValueError):
        return False


def answer_logprobs(model: nn.Module, ids: torch.Tensor, start: int,
                    with_entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The log-probs of the actions ``start..T-2`` of ``ids (B, T)`` only: ``(B, T-1-start)``,
    equal to ``policy_logprobs(model, ids)[:, start:]``. Where the model takes
    ``logits_index`` the LM head and the softmax run on those positions alone (an RLHF
    answer's: the prompt's logits are never needed), which saves the head's share of the
    forward and backward (SmolLM2: a 49k vocabulary, a fifth of the weights).
    ``with_entropy``: also each action's next-token entropy (no grad), ``(lp, entropy)``."""
    start = max(start, 0)
    if start == 0 or not projects_positions(model):
        logits = model(ids)[:, start:-1]
    else:
        logits = model(ids, logits_index=torch.arange(start, ids.shape[1] - 1, device=ids.device))
    lp = torch.log_softmax(logits.float(), dim=-1)
    out = lp.gather(-1, ids[:, start + 1 :].unsqueeze(-1)).squeeze(-1)
    return (out, entropy_of(lp)) if with_entropy else out


def entropy_of(log_probs: torch.Tensor) -> torch.Tensor:
    """``−Σ p·log p`` over the last dim of normalised log-probs, without grad."""
    with torch.no_grad():
        return -(log_probs.exp() * log_probs).sum(-1)


def sequence_logprob(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The sum of the answer's log-probs per row (DPO's ``log π(y|x)``)."""
    return (policy_logprobs(model, ids) * mask).sum(-1)
