"""A language model with a scalar head (DeepSpeed-Chat's ``v_head``): the reward model and
the PPO critic. ``forward(input_ids (B, T))`` returns one value per token ``(B, T)``."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn


def hidden_size(lm: nn.Module) -> int:
    cfg = lm.config
    return getattr(cfg, "hidden_size", None) or cfg.n_embd


class ValueModel(nn.Module):
    """``lm``'s trunk (its LM head replaced by the identity, so the model returns the
    final normalised hidden states) and ``v_head: Linear(hidden, 1, bias=False)``,
    zero-initialised (every value starts at 0)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm
        lm.lm_head = nn.Identity()
        self.v_head = nn.Linear(hidden_size(lm), 1, bias=False)
        nn.init.zeros_(self.v_head.weight)

    @classmethod
    def from_lm(cls, lm: nn.Module) -> ValueModel:
        """A value model over a copy of ``lm`` (``lm`` itself is left as it is)."""
        return cls(copy.deepcopy(lm))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.v_head(self.lm(input_ids)).squeeze(-1).float()

    def save(self, path: str | Path) -> Path:
        """The whole state as one safetensors file."""
        from safetensors.torch import save_file

        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        seen: set[int] = set()
        unique = {}
        for k, v in self.state_dict().items():  # tied weights: one name per tensor; own storage each
            if v.data_ptr() not in seen:
                seen.add(v.data_ptr())
                unique[k] = v.detach().cpu().clone().contiguous()
        save_file(unique, str(p))
        return p


def end_scores(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The value at each row's last answer token: ``values (B, T)`` per token, ``mask (B, T-1)``
    per action (action ``t`` chooses token ``t + 1``)."""
    from zeal.rlhf.formulas import last_index

    last = last_index(mask) + 1
    return values[torch.arange(values.shape[0], device=values.device), last.clamp_min(0)]
