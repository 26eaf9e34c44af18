"""GRPO's forwards with each prompt computed once per group.

The G answers of a prompt share its tokens, which are most of every row (SmolLM2's chat
template wraps a short question in ~45 tokens; answers are ~16). Instead of G full rows,
two passes: the batch's distinct prompts (left-padded to one width, so that every
prompt ends in the last column), whose per-layer keys and values are kept, then the
answers alone, each attending to its prompt's keys/values and causally to itself. The
log-probs are the full rows' (the same sums; fp32 agrees to rounding), gradients flow
through both passes, and the trunk runs on ``P·Lp + N·La`` tokens instead of
``N·(Lp + La)``.

Output layout: answer-aligned ``(N, La)``: column ``j`` is ``log p(answer[j] | prompt,
answer[:j])`` (column 0 comes from the prompt pass's last position).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zeal.rlhf.batch import entropy_of, projects_positions


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``q (B, Tq, nh, hd)`` over ``k/v (B, Tk, nkv, hd)`` with a boolean ``mask (B, 1, Tq, Tk)``."""
    rep = q.shape[-2] // k.shape[-2]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=-2), v.repeat_interleave(rep, dim=-2)
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return y.transpose(1, 2)


class _PromptPass:
    """Attention of the prompt pass: causal over the real tokens (a left pad attends to
    itself only); keeps every layer's keys and values for the answer pass."""

    ops = None  # torch ops (autograd)

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, layer_idx: int, q, k, v, dropout_p: float = 0.0) -> torch.Tensor:
        self.kv[layer_idx] = (k, v)
        return _attend(q, k, v, self.mask)


class _AnswerPass:
    """Attention of the answer pass: each row over its prompt's kept keys/values, then
    causally over its own."""

    ops = None

    def __init__(self, prompt: _PromptPass, group: torch.Tensor, mask: torch.Tensor) -> None:
        self.prompt, self.group, self.mask = prompt, group, mask

    def __call__(self, layer_idx: int, q, k, v, dropout_p: float = 0.0) -> torch.Tensor:
        pk, pv = self.prompt.kv[layer_idx]
        k = torch.cat([pk[self.group], k], dim=1)
        v = torch.cat([pv[self.group], v], dim=1)
        return _attend(q, k, v, self.mask)


def can_share(model: nn.Module) -> bool:
    """Whether :func:`group_logprobs` applies to ``model`` (a zeal ``Llama``/``GPT``, or a
    TrainEngine over one): it takes positions, an attention object and ``logits_index``,
    and is neither under ZeRO-3 (one gather per forward) nor checkpointing activations
    (the recomputed prompt pass would not be the one the answers attended to)."""
    target = getattr(model, "module", model)
    policy = getattr(target, "checkpoint_policy", None)
    stage = getattr(model, "zero_stage", 0)
    return (projects_positions(model) and not (policy is not None and policy.enabled)
            and not (isinstance(stage, int) and stage >= 3))


def group_logprobs(model: nn.Module, prompts: list[list[int]], group: torch.Tensor, answers: torch.Tensor,
                   pad_id: int, with_entropy: bool = False):
    """Answer-aligned log-probs ``(N, La)`` of ``answers (N, La)`` (right-padded with
    ``pad_id``), answer ``i`` following ``prompts[group[i]]``; see the module docstring.
    ``with_entropy``: ``(log-probs, next-token entropies)``."""
    dev = answers.device
    lens = torch.tensor([len(p) for p in prompts], device=dev)
    lp_w, la = int(lens.max()), answers.shape[1]
    off = lp_w - lens  # left padding of each prompt
    ids = torch.full((len(prompts), lp_w), pad_id, dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):
        ids[i, lp_w - len(p):] = torch.tensor(p, dtype=torch.long)
    col = torch.arange(lp_w, device=dev)
    real = col[None, :] >= off[:, None]  # (P, Lp)
    causal = col[None, :] <= col[:, None]  # (Lp, Lp): key j ≤ query i
    pmask = (causal[None] & (real[:, None, :] | torch.eye(lp_w, dtype=torch.bool, device=dev)[None]))[:, None]
    ppass = _PromptPass(pmask)
    ppos = (col[None, :] - off[:, None]).clamp(min=0)
    last = model(ids, positions=ppos, attention=ppass, logits_index=torch.tensor([lp_w - 1], device=dev))
    acol = torch.arange(la, device=dev)
    amask = torch.cat([real[group][:, None, :].expand(-1, la, -1),
                       (acol[None, :] <= acol[:, None])[None].expand(len(group), -1, -1)], dim=-1)[:, None]
    apos = lens[group][:, None] + acol[None, :]
    rest = model(answers, positions=apos, attention=_AnswerPass(ppass, group, amask),
                 logits_index=torch.arange(la - 1, device=dev))
    lp = torch.log_softmax(torch.cat([last[group], rest], dim=1).float(), dim=-1)
    out = lp.gather(-1, answers.unsqueeze(-1)).squeeze(-1)
    return (out, entropy_of(lp)) if with_entropy else out


def answer_batch(rollouts, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(answers, mask, served)``, each ``(N, La)`` answer-aligned: the answer tokens
    right-padded with ``pad_id``, 1 on the tokens the policy chose (``Rollout.loss_mask``;
    0 on padding and tool outputs), the serving engine's log-probs."""
    la = max(1, max(len(r.output_ids) for r in rollouts))
    answers = torch.full((len(rollouts), la), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rollouts), la)
    served = torch.zeros(len(rollouts), la)
    for i, r in enumerate(rollouts):
        n = len(r.output_ids)
        answers[i, :n] = torch.tensor(r.output_ids, dtype=torch.long)
        mask[i, :n] = 1.0 if r.loss_mask is None else torch.tensor(r.loss_mask[:n], dtype=torch.float32)
        lps = r.logprobs[:n]
        served[i, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
    return answers, mask, served


def rollout_logprobs(model: nn.Module, rollouts, answers: torch.Tensor, pad_id: int, with_entropy: bool = False):
    """:func:`group_logprobs` of ``rollouts`` (each prompt once: rows with the same
    ``group`` share it) and their ``answers``, answer-aligned ``(N, La)``."""
    order: dict[int, int] = {}
    prompts: list[list[int]] = []
    for r in rollouts:
        if r.group not in order:
            order[r.group] = len(prompts)
            prompts.append(r.prompt_ids)
    group = torch.tensor([order[r.group] for r in rollouts], device=answers.device)
    return group_logprobs(model, prompts, group, answers, pad_id, with_entropy)
