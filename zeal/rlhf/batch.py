"""Rollouts and examples as padded tensors: right padding (the causal models then need no
attention mask and every row keeps positions ``0..``), with the action mask that
:mod:`zeal.rlhf.formulas` reads."""

from __future__ import annotations

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
         logprobs: list[list[float]] | None = None, device: torch.device | str = "cpu") -> Packed:
    """Right-pad ``prompt + answer`` rows into one batch; answer ``i``'s tokens are the
    actions ``[len(prompt_i) − 1, len(prompt_i) − 1 + len(answer_i))``."""
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
        mask[i, s : s + len(a)] = 1.0
        if logprobs is not None:
            lps[i, s : s + len(a)] = torch.tensor(logprobs[i][: len(a)], dtype=torch.float32)
    return Packed(ids.to(device), mask.to(device), lps.to(device))


def policy_logprobs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Per-action log-probs of ``ids`` under ``model`` (a module or a TrainEngine returning logits)."""
    return token_logprobs(model(ids), ids)


def sequence_logprob(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The sum of the answer's log-probs per row (DPO's ``log π(y|x)``)."""
    return (policy_logprobs(model, ids) * mask).sum(-1)
