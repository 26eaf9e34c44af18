"""The RLHF formulas as pure functions of tensors (fp32): PPO as DeepSpeed-Chat computes it,
the reward model's pairwise ranking loss, DPO and GRPO.

Conventions. A batch of ``B`` sequences of ``T`` tokens (right-padded) gives ``T - 1``
*actions*: action ``t`` is the choice of token ``t + 1`` from the prefix ``[0, t]``.
Per-action tensors (log-probs, values, rewards, advantages) are ``(B, T - 1)`` and
``mask`` marks the actions that belong to an answer (1) rather than to the prompt or the
padding (0); each row's answer is one contiguous run of ones. Nothing here reads the
prompt length or a pad id: the mask says everything, so prompts of different lengths
share a batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over the entries where ``mask`` is 1 (over ``dim``, or all)."""
    m = mask.to(x.dtype)
    if dim is None:
        return (x * m).sum() / m.sum().clamp_min(1.0)
    return (x * m).sum(dim) / m.sum(dim).clamp_min(1.0)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Per-action log-probabilities: ``log_softmax(logits)[:, t]`` at ``tokens[:, t + 1]``;
    ``logits (B, T, V)``, ``tokens (B, T)`` → ``(B, T - 1)`` in fp32."""
    lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return lp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


def last_index(mask: torch.Tensor) -> torch.Tensor:
    """The index of the last 1 of each row of ``mask (B, L)`` (-1 for an all-zero row)."""
    idx = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), idx, torch.full_like(idx, -1)).max(-1).values


def compute_rewards(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, score: torch.Tensor, mask: torch.Tensor,
                    kl_coef: float = 0.1, clip_reward: float | None = 5.0) -> torch.Tensor:
    """PPO's per-action rewards: ``-kl_coef * (logprob - ref_logprob)`` on every answer
    action, plus the reward model's ``score`` (clipped to ``±clip_reward``; None: not
    clipped) on the row's last answer action — the last valid token, never the padding
    after it. Zero outside the answer."""
    m = mask.to(logprobs.dtype)
    rewards = -kl_coef * (logprobs - ref_logprobs) * m
    s = score.to(rewards.dtype)
    if clip_reward is not None:
        s = s.clamp(-clip_reward, clip_reward)
    last = last_index(mask)
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    has = last >= 0
    rewards = rewards.clone()
    rewards[rows[has], last[has]] += s[has]
    return rewards


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation, backwards over the actions:
    ``δ_t = r_t + γ V_{t+1} − V_t`` (``V`` is 0 after the answer), ``A_t = δ_t + γλ A_{t+1}``;
    returns ``(advantages, returns = A + V)``, both zero outside the answer."""
    m = mask.to(values.dtype)
    r, v = rewards * m, values * m
    adv = torch.zeros_like(v)
    nxt_a = torch.zeros_like(v[:, 0])
    nxt_v = torch.zeros_like(v[:, 0])
    for t in range(v.shape[1] - 1, -1, -1):
        delta = r[:, t] + gamma * nxt_v - v[:, t]
        nxt_a = delta + gamma * lam * nxt_a
        adv[:, t] = nxt_a
        nxt_v = v[:, t]
    adv = adv * m
    return adv, (adv + v) * m


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """``(x − mean) / sqrt(var + eps)`` with the mean and (population) variance taken over
    the masked entries; the mean is added back when ``shift_mean`` is false. Zero outside
    the mask."""
    m = mask.to(x.dtype)
    mean = masked_mean(x, m)
    var = masked_mean((x - mean) ** 2, m)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * m


def clipped_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, eps_low: float = 0.2,
                  eps_high: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ratio, clip(ratio, 1 − eps_low, 1 + eps_high))`` with ``ratio = exp(logπ − logπ_old)``
    (``eps_high`` defaults to ``eps_low``)."""
    ratio = torch.exp(logprobs - old_logprobs)
    hi = eps_low if eps_high is None else eps_high
    return ratio, ratio.clamp(1.0 - eps_low, 1.0 + hi)


def actor_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
               clip: float = 0.2) -> torch.Tensor:
    """PPO's clipped surrogate: ``Σ max(−A·ratio, −A·clip(ratio, 1−ε, 1+ε))·mask / Σ mask``.
    Its gradient vanishes where the clipped term is the larger (ratio outside the range
    in the direction the advantage favours)."""
    m = mask.to(logprobs.dtype)
    ratio, clipped = clipped_ratio(logprobs * m, old_logprobs * m, clip)
    loss = torch.maximum(-advantages * ratio, -advantages * clipped)
    return masked_mean(loss, mask)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float = 0.2) -> torch.Tensor:
    """The critic's clipped loss: ``0.5·Σ max((V − R)², (clip(V, V_old ± ε) − R)²)·mask / Σ mask``."""
    v_clip = torch.maximum(torch.minimum(values, old_values + clip), old_values - clip)
    loss = torch.maximum((values - returns) ** 2, (v_clip - returns) ** 2)
    return 0.5 * masked_mean(loss, mask)


@torch.no_grad()
def ema_update(ema: list[torch.Tensor], params: list[torch.Tensor], beta: float = 0.992) -> None:
    """``θ_ema ← β·θ_ema + (1 − β)·θ`` in place, pairwise over the two lists; after ``n``
    updates with constant ``θ``: ``θ_ema = θ + βⁿ(θ_ema₀ − θ)``."""
    if len(ema) != len(params):
        raise ValueError(f"ema_update: {len(ema)} EMA tensors for {len(params)} parameters")
    for e, p in zip(ema, params):
        e.mul_(beta).add_(p.detach().to(e.dtype), alpha=1.0 - beta)


def _end(ids: torch.Tensor, pad_id: int, num_padding_at_beginning: int) -> int:
    """The index of the first pad after the ``num_padding_at_beginning`` leading ones, or the length."""
    pads = (ids == pad_id).nonzero().flatten().tolist()
    return pads[num_padding_at_beginning] if len(pads) > num_padding_at_beginning else ids.numel()


def reward_model_loss(chosen_ids: torch.Tensor, rejected_ids: torch.Tensor, chosen_values: torch.Tensor,
                      rejected_values: torch.Tensor, pad_id: int,
                      num_padding_at_beginning: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSpeed-Chat's token-wise pairwise ranking loss. For each pair of right-padded
    sequences (``ids (B, T)``) with per-token values ``(B, T)``: the end is the first pad
    (after ``num_padding_at_beginning`` leading pads) of either sequence, the later one;
    the divergence is the first index where they differ (identical pairs: the last
    token). The pair's loss is the mean of ``−log σ(v_chosen − v_rejected)`` over
    ``[divergence, end)``. Returns ``(mean loss, chosen scores, rejected scores)``; a score
    is the value at the sequence's last non-pad token."""
    losses, c_scores, r_scores = [], [], []
    seq_len = chosen_ids.shape[1]
    for c_ids, r_ids, c_v, r_v in zip(chosen_ids, rejected_ids, chosen_values, rejected_values):
        c_end = _end(c_ids, pad_id, num_padding_at_beginning)
        diff = (c_ids != r_ids).nonzero().flatten()
        if diff.numel() == 0:  # identical: compare the last token only
            end, div = seq_len, seq_len - 1
            r_end = c_end
        else:
            r_end = _end(r_ids, pad_id, num_padding_at_beginning)
            end, div = max(c_end, r_end), int(diff[0])
        span = slice(div, end)
        losses.append(-F.logsigmoid(c_v[span] - r_v[span]).mean())
        c_scores.append(c_v[c_end - 1])
        r_scores.append(r_v[r_end - 1])
    return torch.stack(losses).mean(), torch.stack(c_scores), torch.stack(r_scores)


def dpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
             ref_rejected_logps: torch.Tensor, beta: float = 0.1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO's sigmoid loss over sequence log-probs (sums over the answer tokens):
    ``−log σ(β·((logπ_c − logπ_ref,c) − (logπ_r − logπ_ref,r)))``, averaged. Returns
    ``(loss, chosen rewards, rejected rewards)`` with reward ``β·(logπ − logπ_ref)`` (detached)."""
    chosen = chosen_logps - ref_chosen_logps
    rejected = rejected_logps - ref_rejected_logps
    loss = -F.logsigmoid(beta * (chosen - rejected)).mean()
    return loss, beta * chosen.detach(), beta * rejected.detach()


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """GRPO's advantages: each reward minus the mean of its group of ``group_size``
    consecutive answers to one prompt, divided by the group's (unbiased) standard
    deviation plus ``eps`` when ``scale`` (a group of equal rewards gets 0)."""
    if rewards.numel() % group_size:
        raise ValueError(f"group_advantages: {rewards.numel()} rewards are not groups of {group_size}")
    g = rewards.float().view(-1, group_size)
    adv = g - g.mean(1, keepdim=True)
    if scale:
        std = g.std(1, keepdim=True) if group_size > 1 else torch.zeros_like(adv)
        adv = torch.where(std > 0, adv / (std + eps), torch.zeros_like(adv))  # a uniform group: 0
    return adv.reshape(-1)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(π‖π_ref) per token: ``e^{d} − d − 1`` with
    ``d = logπ_ref − logπ`` (non-negative, unbiased under samples from π)."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None,
              advantages: torch.Tensor, mask: torch.Tensor, clip: float = 0.2, clip_high: float | None = None,
              beta: float = 0.04, loss_type: str = "sequence") -> torch.Tensor:
    """GRPO's per-token loss ``−min(ratio·A, clip(ratio)·A) + β·k3`` (sequence advantages
    ``A (B,)`` broadcast over the answer), aggregated as ``"sequence"`` (mean over each
    answer, then over answers: the paper) or ``"token"`` (mean over all answer tokens)."""
    ratio, clipped = clipped_ratio(logprobs, old_logprobs, clip, clip_high)
    a = advantages.unsqueeze(-1)
    per_tok = -torch.minimum(ratio * a, clipped * a)
    if ref_logprobs is not None and beta:
        per_tok = per_tok + beta * k3_kl(logprobs, ref_logprobs)
    if loss_type == "sequence":
        return masked_mean(per_tok, mask, dim=-1).mean()
    if loss_type == "token":
        return masked_mean(per_tok, mask)
    raise ValueError(f"grpo_loss: loss_type must be 'sequence' or 'token', got {loss_type!r}")
