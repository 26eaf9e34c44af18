"""GRPO: groups of G sampled answers per prompt, rewards from Python functions, advantages
normalised within each group, a clipped ratio, and the k3 KL to a frozen reference.

Rollouts come from the hybrid engine (:mod:`zeal.rlhf.hybrid`); the behaviour policy's
log-probs are the serving engine's, and the training side's of the same tokens are
compared with them every step (``logprob_diff``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from zeal.inference.sampling_params import SamplingParams
from zeal.rlhf import formulas as fm
from zeal.rlhf import grpo_losses as gl
from zeal.rlhf.adapters import reference_policy
from zeal.rlhf.async_rollouts import RolloutPipeline
from zeal.rlhf.batch import answer_logprobs, pack
from zeal.rlhf.common import (
    RunLog,
    RunResult,
    build_engine,
    disable_dropout,
    dp_slice,
    encode_prompt,
    load_policy,
    sampling_seed,
    say,
    set_seed,
)
from zeal.rlhf.config import split_config
from zeal.rlhf.dapo import fill_groups, informative_groups, soft_overlong_penalty, truncated
from zeal.rlhf.flops import StepFlops
from zeal.rlhf.grpo_losses import canonical_loss_type
from zeal.rlhf.hybrid import HybridEngine, Rollout, generation_dtype
from zeal.rlhf.multiturn import Environment, run_episodes, tool_environment
from zeal.rlhf.packing import packed_logprobs
from zeal.rlhf.shared_prefix import answer_batch, can_share, rollout_logprobs
from zeal.rlhf.verifiers import config_rewards

RewardFn = Callable[..., Sequence[float]]


def score(reward_fn: RewardFn | Sequence[RewardFn], prompts: list[Any], rollouts: list[Rollout]) -> torch.Tensor:
    """The summed rewards of every rollout: each function is called as
    ``fn(prompts, completions, completion_ids=..., **columns)`` (one entry per rollout) and
    returns one float per rollout. Prompts given as rows (dicts with ``prompt``) are passed
    as the rows, and their other fields as columns too (TRL's dataset columns: ``answer=[...]``)."""
    fns = list(reward_fn) if isinstance(reward_fn, (list, tuple)) else [reward_fn]
    ps = [prompts[r.group] for r in rollouts]
    texts = [r.text for r in rollouts]
    ids = [r.output_ids for r in rollouts]
    keys = dict.fromkeys(k for p in ps if isinstance(p, dict) for k in p if k not in ("prompt", "prompts", "completions", "completion_ids"))
    columns = {k: [p.get(k) if isinstance(p, dict) else None for p in ps] for k in keys}
    total = torch.zeros(len(rollouts))
    for fn in fns:
        vals = list(fn(ps, texts, completion_ids=ids, **columns))
        if len(vals) != len(rollouts):
            raise ValueError(f"reward function {getattr(fn, '__name__', fn)!r} returned {len(vals)} values for "
                             f"{len(rollouts)} completions")
        total += torch.tensor([float(v) for v in vals])
    return total


@dataclass
class RolloutBatch:
    """One step's rollouts (``group`` indexes ``prompts``), their summed rewards, the weight
    version that generated them, and the sampling statistics of the step."""

    rollouts: list[Rollout]
    rewards: torch.Tensor
    prompts: list[Any]
    version: int
    stats: dict[str, float]


def _regroup(groups: list[tuple[Any, list[Rollout], torch.Tensor]]) -> tuple[list[Rollout], torch.Tensor, list]:
    """Flatten ``(prompt, rollouts, rewards)`` groups into one batch, renumbering ``group``."""
    rollouts, rewards, prompts = [], [], []
    for g, (prompt, ros, rew) in enumerate(groups):
        for ro in ros:
            ro.group = g
        rollouts += ros
        rewards.append(rew)
        prompts.append(prompt)
    return rollouts, torch.cat(rewards), prompts


def make_batch(hybrid: HybridEngine, step: int, pick: list[int], version: int, prompt_ids: list[list[int]],
               prompts: Sequence[Any], reward_fn, rc, rank: int, sync: bool,
               environment: Callable[[Any], Environment] | None = None) -> RolloutBatch:
    """Generate ``num_generations`` answers to each picked prompt and score them (plus DAPO's
    soft overlong punishment, ``rc.overlong_buffer``). With ``rc.dynamic_sampling`` the groups
    whose rewards are all equal are dropped and more prompts are drawn (a generator seeded
    by the seed, the step and the rank) until ``len(pick)`` groups remain or
    ``max_num_gen_batches`` generations were made; then uniform groups fill the rest.
    ``environment(prompt)``: each answer is a multi-turn episode with a fresh environment
    (:func:`zeal.rlhf.multiturn.run_episodes`); its reward is the episode's plus
    ``reward_fn``'s (None: none) on the final turn's text."""
    G, P = rc.num_generations, len(pick)

    def generate(idx: list[int], attempt: int, sync_now: bool) -> list[tuple[Any, list[Rollout], torch.Tensor]]:
        seed = sampling_seed(rc.seed, step, attempt) + rank * P * G
        params = SamplingParams(n=G, max_tokens=rc.max_new_tokens, temperature=rc.temperature, top_p=rc.top_p,
                                seed=seed, logprobs=0)
        ps = [prompts[i] for i in idx]
        if environment is None:
            ros = hybrid.generate([prompt_ids[i] for i in idx], params, sync=sync_now)
            rew = score(reward_fn, ps, ros)
        else:
            envs = [environment(prompts[i]) for i in idx for _ in range(G)]
            ros, env_rew = run_episodes(hybrid, envs, SamplingParams(**{**params.__dict__, "n": 1}), rc.max_turns,
                                        rc.max_episode_tokens, sync=sync_now)
            tool_calls.extend(float(getattr(e, "calls", 0)) for e in envs)
            for k, ro in enumerate(ros):
                ro.group = k // G
            rew = torch.tensor(env_rew) + (score(reward_fn, ps, ros) if reward_fn is not None else 0.0)
        for ro in ros:
            ro.version = version
        if rc.overlong_buffer:
            rew = rew + soft_overlong_penalty([len(ro.output_ids) for ro in ros], rc.max_new_tokens,
                                              rc.overlong_buffer, rc.overlong_penalty)
        return [(ps[g], ros[g * G:(g + 1) * G], rew[g * G:(g + 1) * G]) for g in range(len(idx))]

    tool_calls: list[float] = []  # per episode, with a tool environment
    groups = generate(pick, 0, sync)
    stats: dict[str, float] = {}
    if rc.dynamic_sampling:
        rng = torch.Generator().manual_seed((rc.seed * 1000003 + step * 7919 + rank) % (1 << 62))
        kept, spare, attempt, seen = [], [], 0, 0
        while True:
            useful = set(informative_groups(torch.cat([g[2] for g in groups]), G).tolist())
            kept += [g for k, g in enumerate(groups) if k in useful]
            spare += [g for k, g in enumerate(groups) if k not in useful]
            seen += len(groups)
            attempt += 1
            if len(kept) >= P or attempt >= rc.max_num_gen_batches:
                break
            groups = generate(torch.randint(len(prompt_ids), (P,), generator=rng).tolist(), attempt, False)
        groups = fill_groups(kept, P, spare)
        stats = {"num_gen_batches": attempt, "informative_groups": len(kept) / seen}
    if tool_calls:
        stats["tool_calls"] = sum(tool_calls) / len(tool_calls)
    rollouts, rewards, ps = _regroup(groups)
    return RolloutBatch(rollouts, rewards, ps, version, stats)


def grpo(model: Any, reward_fn: RewardFn | Sequence[RewardFn] | None, prompts: Sequence[Any], config: Any = None, *,
         tokenizer: Any = None, out: str | None = None, eos_token_ids: list[int] | None = None,
         environment: Callable[[Any], Environment] | None = None) -> RunResult:
    """Train ``model`` (a zeal ``Llama``/``GPT``, a Hugging Face folder, or None: the embedded
    SmolLM2-135M-Instruct) with GRPO on ``prompts`` (texts, chat message lists, or token-id
    lists) against ``reward_fn`` (one function or a list; see :func:`score`). ``config``: a
    dict / JSON path with DeepSpeed engine keys and an ``rlhf`` section
    (:class:`~zeal.rlhf.config.RLHFConfig`). Writes metrics and checkpoints under ``out``.
    With ``rlhf.async_rollouts: k`` ≥ 1 the next batches are generated while the trainer
    updates (:mod:`zeal.rlhf.async_rollouts`); the result's ``extra["async"]`` then holds
    the generator/trainer overlap. ``environment(prompt)``: a fresh
    :class:`~zeal.rlhf.multiturn.Environment` per answer, which then is a multi-turn episode
    (tool outputs masked out of the loss; see :mod:`zeal.rlhf.multiturn`, :class:`ToolEnv`)."""
    engine_cfg, rc = split_config(config)
    reward_fn = config_rewards(reward_fn, rc)  # rlhf.verifiers, rlhf.reward_funcs
    if reward_fn is None and environment is None and not rc.tools:
        raise ValueError("grpo needs a reward function, rlhf.verifiers, or an environment (rlhf.tools)")
    gen = set_seed(rc.seed)
    pol = load_policy(model, tokenizer, eos_token_ids, job="grpo")
    disable_dropout(pol.model)
    if environment is None and rc.tools:
        environment = tool_environment(pol.tokenizer, rc)
    ref = reference_policy(pol.model, engine_cfg) if rc.beta else None  # LoRA: the base, adapters off
    # with an environment each episode's prompt comes from its reset()
    prompt_ids = [encode_prompt(p, pol.tokenizer, rc) for p in prompts] if environment is None else [[]] * len(prompts)
    G = rc.num_generations
    flops = StepFlops(pol.model)  # before ZeRO partitions the weights
    engine = build_engine(pol.model, engine_cfg, rc.batch_size * G, job="grpo")
    flops.bind(engine.device)
    shared = not rc.padding_free and rc.share_prompt and can_share(engine) and (ref is None or can_share(ref))
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

    def draw(step: int) -> list[int]:
        # one global batch drawn alike on every rank, this rank's slice; answer i of global prompt k is
        # sampled with seed base + k·G + i, as one process drawing the whole batch would
        return torch.randint(len(prompt_ids), (P * world,), generator=gen)[r * P:(r + 1) * P].tolist()

    def produce(step: int, pick: list[int], version: int, sync: bool = False) -> RolloutBatch:
        return make_batch(hybrid, step, pick, version, prompt_ids, prompts, reward_fn, rc, r, sync, environment)

    k = rc.async_rollouts
    pipe = None
    if start < rc.steps:
        say("grpo", f"step {start + 1}: generating {G} answers to each of {P * world} prompts (up to "
            f"{rc.max_new_tokens} tokens), scoring them, then {rc.ppo_epochs} training pass(es); a line per step"
            + (f"; rollouts generated up to {k} step(s) ahead, in a background thread" if k else ""))
        if k:
            pipe = RolloutPipeline(k, start + 1, rc.steps, produce, draw, hybrid.snapshot_weights,
                                   hybrid.load_snapshot, threads=rc.async_generator_threads)
    try:
        for step in range(start + 1, rc.steps + 1):
            t_step = time.perf_counter()
            batch = pipe.get(step) if pipe else produce(step, draw(step), step - 1, sync=True)
            t0 = time.perf_counter()
            exact = hybrid.exact_logprobs and batch.version == step - 1
            stats = _train_on(engine, ref, batch.rollouts, batch.rewards, pol.pad_id, rc, exact)
            t_train = time.perf_counter() - t0
            times = hybrid.take_times()
            t_sync, t_wait = pipe.take_sync_wait() if pipe else (times.sync, 0.0)
            if pipe:
                pipe.trained(step, t0)
            run.log(step, reward=batch.rewards.mean().item(), time_generate_s=times.generate, time_train_s=t_train,
                    time_sync_s=t_sync, time_wait_s=t_wait, staleness=step - 1 - batch.version,
                    **batch.stats, **stats, **flops.grpo(batch.rollouts, shared, ref is not None, times.generate,
                                                         t_train, time.perf_counter() - t_step))
            run.checkpoint(engine, step, final=step == rc.steps)
    finally:
        if pipe:
            pipe.close()
    run.close()
    extra = {"hybrid": hybrid}
    if pipe:
        extra["async"] = pipe.timeline.summary()
    return RunResult(engine, run.records, run.out, extra)


def _loss_mask(rollouts: list[Rollout], mask: torch.Tensor, rc) -> torch.Tensor:
    """The answer mask with DAPO's overlong filtering applied (``rc.mask_truncated_completions``:
    an answer cut by the length limit carries no loss)."""
    if rc.mask_truncated_completions:
        mask = mask * (1.0 - truncated([r.finish_reason for r in rollouts]))[:, None]
    return mask


def _step_tokens(mask: torch.Tensor, chunks: list[slice], gas: int, engine) -> list[float]:
    """Loss tokens of each optimizer step (``gas`` consecutive micro-batches), summed over the
    data-parallel ranks: dapo's and cispo's normaliser (TRL's ``num_items_in_batch``)."""
    counts = torch.tensor([float(sum(mask[c].sum() for c in chunks[i:i + gas])) for i in range(0, len(chunks), gas)],
                          dtype=torch.float64)
    comm = getattr(getattr(engine, "mesh", None), "dp", None)
    if comm is not None and comm.active:
        counts = counts.to(comm.ctx.device)
        comm.all_reduce(counts, "control")
    return counts.cpu().tolist()


def _train_on(engine, ref, rollouts: list[Rollout], rewards: torch.Tensor, pad_id: int, rc,
              exact: bool = True) -> dict:
    """``ppo_epochs`` passes of the GRPO-family loss (``rc.loss_type``,
    :mod:`zeal.rlhf.grpo_losses`) over one rollout batch (in the engine's micro-batches);
    returns the step's loss, KL, answer length, log-prob gap, entropy, clip fractions and
    the mismatch weights' range. Each prompt goes through the trunk once per group
    (``rc.share_prompt``, :mod:`zeal.rlhf.shared_prefix`) where the model allows, and only
    the answer positions are projected by the LM head. Behaviour log-probs: the serving
    engine's when ``exact`` (it generated with the actor's weights in the actor's dtype),
    else the training side's before any update (the current pass's own, detached, when the
    batch makes a single optimizer step), the tokens then weighted by the truncated
    importance ratio of the training side's to the generator's log-probs
    (``rc.importance_sampling_correction``)."""
    loss_type = canonical_loss_type(rc.loss_type)
    adv = fm.group_advantages(rewards, rc.num_generations, rc.scale_rewards)
    if rc.padding_free:
        rows = [r.prompt_ids + r.output_ids for r in rollouts]
        b = pack([r.prompt_ids for r in rollouts], [r.output_ids for r in rollouts], pad_id,
                 [r.logprobs for r in rollouts], loss_masks=[r.loss_mask for r in rollouts])
        s0 = min(len(r.prompt_ids) for r in rollouts) - 1
        mask, served = b.mask[:, s0:], b.logprobs[:, s0:]

        def logprobs(model, s=slice(None), ent=False):
            return packed_logprobs(model, rows[s], s0, ent, width=mask.shape[1])
    elif rc.share_prompt and can_share(engine) and (ref is None or can_share(ref)):
        answers, mask, served = answer_batch(rollouts, pad_id)

        def logprobs(model, s=slice(None), ent=False):
            return rollout_logprobs(model, rollouts[s], answers[s], pad_id, ent)
    else:
        b = pack([r.prompt_ids for r in rollouts], [r.output_ids for r in rollouts], pad_id,
                 [r.logprobs for r in rollouts], loss_masks=[r.loss_mask for r in rollouts])
        s0 = min(len(r.prompt_ids) for r in rollouts) - 1  # the first answer action of any row
        mask, served = b.mask[:, s0:], b.logprobs[:, s0:]

        def logprobs(model, s=slice(None), ent=False):
            return answer_logprobs(model, b.ids[s], s0, ent)
    mask = _loss_mask(rollouts, mask, rc)
    n = len(rollouts)
    mb = engine.micro_batch
    gas = engine.grad_accum
    chunks = [slice(i, min(i + mb, n)) for i in range(0, n, mb)]
    if len(chunks) % gas:
        raise ValueError(f"grpo: {n} rollouts make {len(chunks)} micro-batches of {mb}, not a multiple of "
                         f"gradient_accumulation_steps {gas}")
    one_update = rc.ppo_epochs == 1 and len(chunks) == gas
    by_items = loss_type in ("dapo", "cispo")
    step_tokens = _step_tokens(mask, chunks, gas, engine) if by_items else []
    world = dp_slice(engine)[1]
    correct = rc.importance_sampling_correction and not exact
    with torch.no_grad():
        ref_lp = logprobs(ref) if ref is not None else None
        old = served
        if not exact and not one_update:
            engine.train()
            old = torch.cat([logprobs(engine, s) for s in chunks])
    engine.train()
    losses, gap = [], 0.0
    metrics: dict[str, list[float]] = {}
    ent_sum, ent_n, w_seen = 0.0, 0.0, []
    for epoch in range(rc.ppo_epochs):
        for ci, s in enumerate(chunks):
            m = mask[s]
            lp, ent = logprobs(engine, s, True)
            if epoch == 0:  # before any update: the serving engine's log-probs of the same weights
                gap = max(gap, float(((lp.detach() - served[s]).abs() * m).max()))
                ent_sum, ent_n = ent_sum + float((ent * m).sum()), ent_n + float(m.sum())
            o = old[s] if exact or not one_update else lp.detach()
            w = (gl.mismatch_weights(o, served[s], m, rc.importance_sampling_mode, rc.importance_sampling_cap,
                                     rc.importance_sampling_min) if correct else None)
            if w is not None and epoch == 0:
                w_seen.append(w.expand_as(m)[m.bool()])
            emask = gl.high_entropy_mask(ent, m, rc.top_entropy_quantile) if rc.top_entropy_quantile < 1 else None
            loss, met = gl.policy_loss(
                lp, o, adv[s], m, loss_type=loss_type, importance_sampling_level=rc.importance_sampling_level,
                eps_low=rc.clip, eps_high=rc.clip_high, ref_logprobs=ref_lp[s] if ref_lp is not None else None,
                beta=rc.beta, is_weights=w, max_completion_length=rc.max_new_tokens,
                num_items=step_tokens[ci // gas] / world if by_items else None, entropy_mask=emask)
            # dapo/cispo are normalised by the step's token count already: no division by the accumulation steps
            engine.backward(loss, scale_wrt_gas=not by_items)
            engine.step()
            losses.append(loss.item() * (gas if by_items else 1))
            for k, v in met.items():
                metrics.setdefault(k, []).append(v)
    out = {"loss": sum(losses) / len(losses), "kl": 0.0, "response_length": mask.sum(-1).mean().item(),
           "logprob_diff": gap, "entropy": ent_sum / max(ent_n, 1.0)}
    out.update({k: sum(v) / len(v) for k, v in metrics.items()})
    if w_seen:
        ws = torch.cat(w_seen)
        if ws.numel():
            out.update(is_ratio_mean=float(ws.mean()), is_ratio_min=float(ws.min()), is_ratio_max=float(ws.max()))
    return out
