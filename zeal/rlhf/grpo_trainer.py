"""GRPO: groups of G sampled answers per prompt, rewards from Python functions, advantages
normalised within each group, a clipped ratio, and the k3 KL to a frozen reference.

Rollouts come from the hybrid engine (:mod:`zeal.rlhf.hybrid`); the behaviour policy's
log-probs are the serving engine's, and the training side's of the same tokens are
compared with them every step (``logprob_diff``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from zeal.inference.sampling_params import SamplingParams
from zeal.lora.rlhf import reference_policy
from zeal.rlhf import formulas as fm
from zeal.rlhf.batch import answer_logprobs, pack
from zeal.rlhf.common import (
    RunLog,
    RunResult,
    build_engine,
    disable_dropout,
    dp_slice,
    encode_prompt,
    load_policy,
    say,
    set_seed,
)
from zeal.rlhf.config import split_config
from zeal.rlhf.hybrid import HybridEngine, Rollout, generation_dtype
from zeal.rlhf.shared_prefix import answer_batch, can_share, rollout_logprobs

RewardFn = Callable[..., Sequence[float]]


def score(reward_fn: RewardFn | Sequence[RewardFn], prompts: list[Any], rollouts: list[Rollout]) -> torch.Tensor:
    """The summed rewards of every rollout: each function is called as
    ``fn(prompts, completions, completion_ids=...)`` (one entry per rollout) and returns
    one float per rollout."""
    fns = list(reward_fn) if isinstance(reward_fn, (list, tuple)) else [reward_fn]
    ps = [prompts[r.group] for r in rollouts]
    texts = [r.text for r in rollouts]
    ids = [r.output_ids for r in rollouts]
    total = torch.zeros(len(rollouts))
    for fn in fns:
        vals = list(fn(ps, texts, completion_ids=ids))
        if len(vals) != len(rollouts):
            raise ValueError(f"reward function {getattr(fn, '__name__', fn)!r} returned {len(vals)} values for "
                             f"{len(rollouts)} completions")
        total += torch.tensor([float(v) for v in vals])
    return total


def grpo(model: Any, reward_fn: RewardFn | Sequence[RewardFn], prompts: Sequence[Any], config: Any = None, *,
         tokenizer: Any = None, out: str | None = None, eos_token_ids: list[int] | None = None) -> RunResult:
    """Train ``model`` (a zeal ``Llama``/``GPT``, a Hugging Face folder, or None: the embedded
    SmolLM2-135M-Instruct) with GRPO on ``prompts`` (texts, chat message lists, or token-id
    lists) against ``reward_fn`` (one function or a list; see :func:`score`). ``config``: a
    dict / JSON path with DeepSpeed engine keys and an ``rlhf`` section
    (:class:`~zeal.rlhf.config.RLHFConfig`). Writes metrics and checkpoints under ``out``."""
    engine_cfg, rc = split_config(config)
    gen = set_seed(rc.seed)
    pol = load_policy(model, tokenizer, eos_token_ids, job="grpo")
    disable_dropout(pol.model)
    ref = reference_policy(pol.model, engine_cfg) if rc.beta else None  # LoRA: the base, adapters off
    prompt_ids = [encode_prompt(p, pol.tokenizer, rc) for p in prompts]
    G = rc.num_generations
    engine = build_engine(pol.model, engine_cfg, rc.batch_size * G, job="grpo")
    say("grpo", f"building the serving engine for the rollouts (KV cache {rc.kv_cache_bytes / 2**20:.0f} MiB)")
    hybrid = HybridEngine(engine, pol.tokenizer, eos_token_ids=pol.eos_ids, kv_cache_bytes=rc.kv_cache_bytes,
                          dtype=generation_dtype(rc.generation_dtype, next(engine.module.parameters()).dtype,
                                                 engine.device))
    run = RunLog(out, engine.rank, "grpo", rc, engine.mesh.dp)
    start = run.resume(engine)
    r, world = dp_slice(engine)
    P = rc.batch_size
    gen.manual_seed(rc.seed * 1000003)
    for _ in range(start):  # the prompt order continues where it stopped
        torch.randint(len(prompt_ids), (P * world,), generator=gen)
    if start < rc.steps:
        say("grpo", f"step {start + 1}: generating {G} answers to each of {P * world} prompts (up to "
            f"{rc.max_new_tokens} tokens), scoring them, then {rc.ppo_epochs} training pass(es); a line per step")
    for step in range(start + 1, rc.steps + 1):
        # one global batch drawn alike on every rank, this rank's slice; answer i of global prompt k is
        # sampled with seed base + k·G + i, as one process drawing the whole batch would
        pick = torch.randint(len(prompt_ids), (P * world,), generator=gen)[r * P:(r + 1) * P].tolist()
        params = SamplingParams(n=G, max_tokens=rc.max_new_tokens, temperature=rc.temperature, top_p=rc.top_p,
                                seed=(rc.seed + 7919 * step) % (1 << 62) + r * P * G, logprobs=0)
        rollouts = hybrid.generate([prompt_ids[i] for i in pick], params)
        rewards = score(reward_fn, [prompts[i] for i in pick], rollouts)
        t0 = time.perf_counter()
        stats = _train_on(engine, ref, rollouts, rewards, pol.pad_id, rc, hybrid.exact_logprobs)
        t_train = time.perf_counter() - t0
        times = hybrid.take_times()
        run.log(step, reward=rewards.mean().item(), time_generate_s=times.generate, time_train_s=t_train,
                time_sync_s=times.sync, **stats)
        run.checkpoint(engine, step, final=step == rc.steps)
    run.close()
    return RunResult(engine, run.records, run.out, {"hybrid": hybrid})


def _train_on(engine, ref, rollouts: list[Rollout], rewards: torch.Tensor, pad_id: int, rc,
              exact: bool = True) -> dict:
    """``ppo_epochs`` passes of the GRPO loss over one rollout batch (in the engine's
    micro-batches); returns the step's loss, KL, answer length and log-prob gap. Each
    prompt goes through the trunk once per group (``rc.share_prompt``,
    :mod:`zeal.rlhf.shared_prefix`) where the model allows, and only the answer positions
    are projected by the LM head. Behaviour log-probs: the serving engine's when ``exact``
    (it generated in the actor's dtype), else the training side's before any update (the
    current pass's own, detached, when the batch makes a single optimizer step)."""
    adv = fm.group_advantages(rewards, rc.num_generations, rc.scale_rewards)
    if rc.share_prompt and can_share(engine) and (ref is None or can_share(ref)):
        answers, mask, served = answer_batch(rollouts, pad_id)

        def logprobs(model, s=slice(None)):
            return rollout_logprobs(model, rollouts[s], answers[s], pad_id)
    else:
        b = pack([r.prompt_ids for r in rollouts], [r.output_ids for r in rollouts], pad_id,
                 [r.logprobs for r in rollouts])
        s0 = min(len(r.prompt_ids) for r in rollouts) - 1  # the first answer action of any row
        mask, served = b.mask[:, s0:], b.logprobs[:, s0:]

        def logprobs(model, s=slice(None)):
            return answer_logprobs(model, b.ids[s], s0)
    n = len(rollouts)
    mb = engine.train_micro_batch_size_per_gpu()
    gas = engine.gradient_accumulation_steps()
    chunks = [slice(i, min(i + mb, n)) for i in range(0, n, mb)]
    if len(chunks) % gas:
        raise ValueError(f"grpo: {n} rollouts make {len(chunks)} micro-batches of {mb}, not a multiple of "
                         f"gradient_accumulation_steps {gas}")
    one_update = rc.ppo_epochs == 1 and len(chunks) == gas
    with torch.no_grad():
        ref_lp = logprobs(ref) if ref is not None else None
        old = served
        if not exact and not one_update:
            engine.train()
            old = torch.cat([logprobs(engine, s) for s in chunks])
    engine.train()
    losses, kls, gap = [], [], 0.0
    for epoch in range(rc.ppo_epochs):
        for s in chunks:
            lp = logprobs(engine, s)
            m = mask[s]
            if epoch == 0:  # before any update: the serving engine's log-probs of the same weights
                gap = max(gap, float(((lp.detach() - served[s]).abs() * m).max()))
            o = old[s] if exact or not one_update else lp.detach()
            r_lp = ref_lp[s] if ref_lp is not None else None
            loss = fm.grpo_loss(lp, o, r_lp, adv[s], m, rc.clip, rc.clip_high, rc.beta, rc.loss_type)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if r_lp is not None:
                kls.append(fm.masked_mean(fm.k3_kl(lp.detach(), r_lp), m).item())
    return {"loss": sum(losses) / len(losses), "kl": sum(kls) / len(kls) if kls else 0.0,
            "response_length": mask.sum(-1).mean().item(), "logprob_diff": gap}
