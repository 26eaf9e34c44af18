"""PPO as DeepSpeed-Chat's step 3: actor (trainable, generating through the hybrid
engine), critic (trainable value model), frozen reference, and a reward (a frozen
reward model or a Python function). Per rollout batch: rewards = the score on the last
answer token minus β·KL per token, GAE with γ and λ, optional advantage whitening, then
``ppo_epochs`` passes of the clipped actor loss (with an optional unsupervised LM loss
mixed in, and an EMA of the actor) and the clipped critic loss."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zeal.inference.sampling_params import SamplingParams
from zeal.rlhf import formulas as fm
from zeal.rlhf.adapters import reference_policy, without_lora
from zeal.rlhf.batch import Packed, answer_logprobs, pack, policy_logprobs
from zeal.rlhf.common import (
    RunLog,
    RunResult,
    build_engine,
    disable_dropout,
    dp_slice,
    encode_prompt,
    frozen_copy,
    load_policy,
    sampling_seed,
    say,
    set_seed,
)
from zeal.rlhf.config import split_config
from zeal.rlhf.flops import StepFlops
from zeal.rlhf.grpo_trainer import score
from zeal.rlhf.hybrid import HybridEngine, generation_dtype
from zeal.rlhf.value import ValueModel, end_scores

log = logging.getLogger("zeal.rlhf")


class EMA:
    """An fp32 moving average of the actor's full weights (gathered unit by unit at stage 3)."""

    def __init__(self, engine, beta: float) -> None:
        self.beta = beta
        self.params = {n: p.detach().float().cpu().clone() for n, p in engine.iter_gathered_parameters()}

    def update(self, engine) -> None:
        for name, p in engine.iter_gathered_parameters():
            fm.ema_update([self.params[name]], [p.detach().float().cpu()], self.beta)

    def save(self, path: Path) -> None:
        """Write the average as safetensors (a temporary file renamed into place)."""
        from safetensors.torch import save_file

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        save_file({k: v.contiguous() for k, v in self.params.items()}, str(tmp))
        os.replace(tmp, path)

    def load(self, path: Path) -> None:
        """Replace the average with the one saved at ``path`` (the same parameter names)."""
        from safetensors.torch import load_file

        saved = load_file(str(path))
        if set(saved) != set(self.params):
            missing = sorted(set(self.params) ^ set(saved))
            raise ValueError(f"{path}: the EMA's parameters do not match the actor's (e.g. {missing[0]})")
        self.params = {k: v.float() for k, v in saved.items()}


def _ema_file(run: RunLog, tag: str) -> Path:
    return run.ckpt_dir / "ema" / f"{tag}.safetensors"


def _resume_ema(ema: EMA, run: RunLog) -> None:
    """The EMA saved with the checkpoint the run resumes from (a checkpoint without one,
    from before the EMA was saved: the average restarts from the resumed weights)."""
    from zeal.checkpoint.files import read_latest

    tag = read_latest(run.ckpt_dir)
    path = _ema_file(run, tag) if tag else None
    if path is not None and path.exists():
        ema.load(path)
    else:
        log.warning("ppo: checkpoint %s holds no actor EMA; the EMA restarts from the resumed weights", tag)


def ppo(model: Any, reward: Callable[..., Sequence[float]] | nn.Module, prompts: Sequence[Any], config: Any = None, *,
        critic: nn.Module | None = None, tokenizer: Any = None, out: str | None = None,
        unsup_data: Sequence[list[int]] | None = None, eos_token_ids: list[int] | None = None) -> RunResult:
    """Train ``model`` (as :func:`zeal.rlhf.grpo`) with PPO. ``reward``: a frozen
    :class:`~zeal.rlhf.value.ValueModel` (its value at the last answer token is the score)
    or a Python function (as GRPO's reward functions). ``critic``: a ValueModel (default:
    one over a copy of the reward model, else of the actor). ``unsup_data``: token-id
    lists for the PPO-ptx loss (weighted by ``rlhf.unsup_coef``)."""
    engine_cfg, rc = split_config(config)
    gen = set_seed(rc.seed)
    pol = load_policy(model, tokenizer, eos_token_ids, job="ppo")
    disable_dropout(pol.model)
    ref = reference_policy(pol.model, engine_cfg)  # LoRA: the actor's base with adapters off
    if critic is None:
        critic = ValueModel.from_lm(reward.lm) if isinstance(reward, ValueModel) else ValueModel.from_lm(pol.model)
    if isinstance(reward, nn.Module):
        reward = frozen_copy(reward)
    prompt_ids = [encode_prompt(p, pol.tokenizer, rc) for p in prompts]
    # counted before ZeRO partitions the weights
    flops, critic_flops = StepFlops(pol.model), StepFlops(critic)
    reward_flops = StepFlops(reward) if isinstance(reward, nn.Module) else None
    actor = build_engine(pol.model, engine_cfg, rc.batch_size, job="ppo", what="actor engine")
    critic_engine = build_engine(critic, without_lora(engine_cfg), rc.batch_size, lr=rc.critic_lr, job="ppo",
                                 what="critic engine")
    hybrid = HybridEngine(actor, pol.tokenizer, eos_token_ids=pol.eos_ids, kv_cache_bytes=rc.kv_cache_bytes,
                          dtype=generation_dtype(rc.generation_dtype, next(actor.module.parameters()).dtype,
                                                 actor.device))
    flops.bind(actor.device)
    run = RunLog(out, actor.rank, "ppo", rc, actor.mesh.dp)
    start = run.resume(actor)
    if start:
        run.resume(critic_engine, sub="critic")
    ema = EMA(actor, rc.ema) if rc.ema is not None else None
    if ema is not None and start:
        _resume_ema(ema, run)
    r, world = dp_slice(actor)
    B = rc.batch_size
    gen.manual_seed(rc.seed * 1000003)
    for _ in range(start):  # the prompt (and unsupervised row) order continues where it stopped
        torch.randint(len(prompt_ids), (B * world,), generator=gen)
        if unsup_data and rc.unsup_coef:
            torch.randint(len(unsup_data), (B * world,), generator=gen)
    if start < rc.steps:
        say("ppo", f"step {start + 1}: generating answers to {B * world} prompts (up to {rc.max_new_tokens} "
            "tokens), scoring them, then the actor and critic updates; a line per step")
    for step in range(start + 1, rc.steps + 1):  # one global batch, this rank's slice (as GRPO)
        t_step = time.perf_counter()
        pick = torch.randint(len(prompt_ids), (B * world,), generator=gen)[r * B:(r + 1) * B].tolist()
        params = SamplingParams(max_tokens=rc.max_new_tokens, temperature=rc.temperature, top_p=rc.top_p,
                                seed=sampling_seed(rc.seed, step) + r * B, logprobs=0)
        rollouts = hybrid.generate([prompt_ids[i] for i in pick], params, reload_next=True)  # next step syncs
        b = pack([r.prompt_ids for r in rollouts], [r.output_ids for r in rollouts], pol.pad_id,
                 [r.logprobs for r in rollouts])
        t0 = time.perf_counter()
        with torch.no_grad():
            if isinstance(reward, nn.Module):
                scores = end_scores(reward(b.ids), b.mask)
            else:
                scores = score(reward, [prompts[i] for i in pick], rollouts)
        ptx = None
        if unsup_data and rc.unsup_coef:
            ptx = [unsup_data[i] for i in torch.randint(len(unsup_data), (B * world,), generator=gen)[r * B:(r + 1) * B]]
        stats = ppo_update(actor, critic_engine, ref, b, scores, rc, ptx, pol.pad_id, ema, hybrid.exact_logprobs)
        t_train = time.perf_counter() - t0
        times = hybrid.take_times()
        work = flops.ppo(rollouts, critic_flops, reward_flops, rc.ppo_epochs, [len(p) for p in ptx or []],
                         times.generate, t_train, time.perf_counter() - t_step)
        run.log(step, reward=scores.mean().item(), time_generate_s=times.generate, time_train_s=t_train,
                time_sync_s=times.sync, **stats, **work)
        run.checkpoint(critic_engine, step, final=step == rc.steps, sub="critic")
        if ema is not None and run.enabled and run.saves(step, final=step == rc.steps):
            ema.save(_ema_file(run, f"step{step}"))  # before the actor's checkpoint, whose `latest` commits
        run.checkpoint(actor, step, final=step == rc.steps)
    if ema is not None and run.enabled:
        ema.save(run.out / "actor_ema.safetensors")
    run.close()
    return RunResult(actor, run.records, run.out, {"critic": critic_engine, "hybrid": hybrid, "ema": ema})


def ppo_update(actor, critic, ref: nn.Module, b: Packed, scores: torch.Tensor, rc, ptx: list[list[int]] | None,
               pad_id: int, ema: EMA | None, exact: bool = True) -> dict:
    """One PPO iteration over a rollout batch; returns the metrics of the step. Tensors
    start at the first answer action of any row (the LM head projects only from there).
    Behaviour log-probs: the serving engine's when ``exact`` (it generated in the actor's
    dtype), else the training side's first forward, detached (before any update)."""
    rows = b.mask.any(-1)
    s0 = int(b.mask.argmax(-1)[rows].min()) if rows.any() else 0  # argmax: a row's first 1
    m = b.mask[:, s0:]
    actor.train()
    lp0 = answer_logprobs(actor, b.ids, s0)
    old_lp = b.logprobs[:, s0:] if exact else lp0.detach()
    with torch.no_grad():
        ref_lp = answer_logprobs(ref, b.ids, s0)
        critic.eval()
        old_values = critic(b.ids)[:, s0:-1]
        rewards = fm.compute_rewards(old_lp, ref_lp, scores, m, rc.kl_coef, rc.clip_reward)
        adv, returns = fm.gae(rewards, old_values, m, rc.gamma, rc.lam)
        if rc.whiten_advantages:
            adv = fm.whiten(adv, m)
    critic.train()
    a_losses, v_losses, gap = [], [], 0.0
    for epoch in range(rc.ppo_epochs):
        lp = lp0 if epoch == 0 else answer_logprobs(actor, b.ids, s0)
        if epoch == 0:  # before any update: the serving engine's log-probs of the same weights
            gap = float(((lp.detach() - b.logprobs[:, s0:]).abs() * m).max())
        loss = fm.actor_loss(lp, old_lp, adv, m, rc.clip)
        actor.backward(loss)
        actor.step()
        a_losses.append(loss.item())
        if ptx is not None:
            u = pack([p[:1] for p in ptx], [p[1:] for p in ptx], pad_id)
            lm = -fm.masked_mean(policy_logprobs(actor, u.ids), u.mask)
            actor.backward(rc.unsup_coef * lm)
            actor.step()
        if ema is not None:
            ema.update(actor)
        v = critic(b.ids)[:, s0:-1]
        vloss = fm.value_loss(v, old_values, returns, m, rc.clip_value)
        critic.backward(vloss)
        critic.step()
        v_losses.append(vloss.item())
    return {"loss": sum(a_losses) / len(a_losses), "value_loss": sum(v_losses) / len(v_losses),
            "kl": fm.masked_mean(old_lp - ref_lp, m).item(), "response_length": b.response_lengths.mean().item(),
            "logprob_diff": gap}
