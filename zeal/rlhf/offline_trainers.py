"""The offline steps: SFT (loss on the assistant tokens only), the reward model (pairwise
ranking loss, accuracy on held-out pairs) and DPO (sigmoid loss, reference log-probs
computed once before training)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from zeal.rlhf import formulas as fm
from zeal.rlhf.batch import pack, sequence_logprob
from zeal.rlhf.common import (
    RunLog,
    RunResult,
    build_engine,
    disable_dropout,
    dp_slice,
    load_policy,
    say,
    set_seed,
)
from zeal.rlhf.config import split_config
from zeal.rlhf.data import encode_pair, encode_sft, free_token, pad_rows
from zeal.rlhf.flops import StepFlops
from zeal.rlhf.packing import packed_logprobs
from zeal.rlhf.value import ValueModel


def _batches(n: int, size: int, gen: torch.Generator):
    """Endless shuffled index batches (a new permutation per pass)."""
    while True:
        order = torch.randperm(n, generator=gen).tolist()
        for i in range(0, n - size + 1 if n >= size else 1, size):
            yield [order[j % n] for j in range(i, i + size)]


def _rank_batches(n: int, size: int, gen: torch.Generator, engine):
    """This rank's ``size`` rows of each global batch of ``size`` × the data-parallel size
    (every rank draws the same global batches from ``gen``)."""
    r, world = dp_slice(engine)
    for batch in _batches(n, size * world, gen):
        yield batch[r * size:(r + 1) * size]


def _loop(job: str, engine, out, rc, step_fn, batches=None, flops: StepFlops | None = None) -> RunLog:
    """Run ``step_fn(step)`` for the remaining steps, logging its stats; a ``flops`` entry in
    them (the step's FLOP count) becomes ``tflops`` / ``mfu`` over the step's seconds
    (``flops.dpo``)."""
    run = RunLog(out, engine.rank, job, rc, engine.mesh.dp)
    start = run.resume(engine)
    for _ in range(start if batches is not None else 0):  # the row order continues where it stopped
        next(batches)
    engine.train()
    for step in range(start + 1, rc.steps + 1):
        t0 = time.perf_counter()
        stats = step_fn(step)
        dt = time.perf_counter() - t0
        lengths = stats.pop("rows", None)
        if flops is not None and lengths is not None:
            stats.update(flops.dpo(lengths, dt))
        run.log(step, time_train_s=dt, time_generate_s=0.0, time_sync_s=0.0, **stats)
        run.checkpoint(engine, step, final=step == rc.steps)
    run.close()
    return run


def sft(model: Any, data: Sequence[dict], config: Any = None, *, tokenizer: Any = None, out: str | None = None,
        eos_token_ids: list[int] | None = None) -> RunResult:
    """Supervised fine-tuning on rows with ``messages`` (chat template; loss on the assistant
    turns only) or ``prompt`` + ``completion`` (loss on the completion)."""
    engine_cfg, rc = split_config(config)
    gen = set_seed(rc.seed)
    pol = load_policy(model, tokenizer, eos_token_ids, job="sft")
    examples = [encode_sft(r, pol.tokenizer, pol.eos_ids, rc) for r in data]
    engine = build_engine(pol.model, engine_cfg, rc.batch_size, job="sft")
    batches = _rank_batches(len(examples), rc.batch_size, gen, engine)

    def step_fn(step):
        pick = next(batches)
        rows = [examples[i][0] for i in pick]
        mask = pad_rows([examples[i][1] for i in pick], 0)[:, 1:].float()
        if rc.padding_free:
            lp = packed_logprobs(engine, rows)
        else:
            ids = pad_rows(rows, pol.pad_id)
            lp = fm.token_logprobs(engine(ids), ids)
        loss = -fm.masked_mean(lp, mask)
        engine.backward(loss)
        engine.step()
        return {"loss": loss.item(), "response_length": mask.sum(-1).mean().item()}

    run = _loop("sft", engine, out, rc, step_fn, batches)
    return RunResult(engine, run.records, run.out)


def _pair_batch(pairs, pick):
    chosen = [pairs[i][0] + pairs[i][1] for i in pick]
    rejected = [pairs[i][0] + pairs[i][2] for i in pick]
    pad = free_token(chosen + rejected)
    return pad_rows(chosen + rejected, pad), pad


def reward_model(model: Any, data: Sequence[dict], config: Any = None, *, tokenizer: Any = None,
                 out: str | None = None, eos_token_ids: list[int] | None = None) -> RunResult:
    """Train a reward model (``model`` with a scalar head) on ``prompt``/``chosen``/``rejected``
    rows with DeepSpeed-Chat's pairwise ranking loss; ``rlhf.eval_fraction`` of the pairs
    are held out and the accuracy on them (chosen scored above rejected) is logged."""
    engine_cfg, rc = split_config(config)
    gen = set_seed(rc.seed)
    pol = load_policy(model, tokenizer, eos_token_ids, job="rm")
    pairs = [encode_pair(r, pol.tokenizer, pol.eos_ids, rc) for r in data]
    order = torch.randperm(len(pairs), generator=gen).tolist()
    n_eval = int(len(pairs) * rc.eval_fraction)
    held, train = [pairs[i] for i in order[:n_eval]], [pairs[i] for i in order[n_eval:]]
    if not train:
        raise ValueError(f"reward model: no training pairs left after holding out {n_eval} of {len(pairs)}")
    vm = ValueModel(pol.model)
    engine = build_engine(vm, engine_cfg, 2 * rc.batch_size, job="rm")
    batches = _rank_batches(len(train), rc.batch_size, gen, engine)

    def scores(p, pick):
        ids, pad = _pair_batch(p, pick)
        loss, c, r = fm.reward_model_loss(*ids.chunk(2), *engine(ids).chunk(2), pad)
        return loss, c, r

    def step_fn(step):
        loss, c, r = scores(train, next(batches))
        engine.backward(loss)
        engine.step()
        stats = {"loss": loss.item(), "reward": (c - r).mean().item(), "kl": 0.0}
        if held and (step % rc.log_every == 0 or step == rc.steps):
            with torch.no_grad():
                engine.eval()
                _, hc, hr = scores(held, list(range(len(held))))
                engine.train()
            stats["accuracy"] = (hc > hr).float().mean().item()
        return stats

    run = _loop("rm", engine, out, rc, step_fn, batches)
    return RunResult(engine, run.records, run.out, {"value_model": vm})


def dpo(model: Any, data: Sequence[dict], config: Any = None, *, tokenizer: Any = None, out: str | None = None,
        eos_token_ids: list[int] | None = None) -> RunResult:
    """Direct preference optimisation on ``prompt``/``chosen``/``rejected`` rows: the sigmoid
    loss with ``rlhf.dpo_beta``; the reference log-probs of every pair are computed once,
    with the initial weights, before training."""
    engine_cfg, rc = split_config(config)
    gen = set_seed(rc.seed)
    pol = load_policy(model, tokenizer, eos_token_ids, job="dpo")
    disable_dropout(pol.model)
    pairs = [encode_pair(r, pol.tokenizer, pol.eos_ids, rc) for r in data]
    prompts = [p for p, _, _ in pairs]
    chosen = pack(prompts, [c for _, c, _ in pairs], pol.pad_id)
    rejected = pack(prompts, [r for _, _, r in pairs], pol.pad_id)
    was = pol.model.training
    pol.model.eval()
    say("dpo", f"reference log-probs of the {len(pairs)} chosen/rejected pairs with the initial weights "
        "(once, before step 1)")
    with torch.no_grad():  # once, with the initial weights
        ref_c = torch.cat([sequence_logprob(pol.model, chosen.ids[i:i + 16], chosen.mask[i:i + 16])
                           for i in range(0, len(pairs), 16)])
        ref_r = torch.cat([sequence_logprob(pol.model, rejected.ids[i:i + 16], rejected.mask[i:i + 16])
                           for i in range(0, len(pairs), 16)])
    pol.model.train(was)
    flops = StepFlops(pol.model)  # before ZeRO partitions the weights
    engine = build_engine(pol.model, engine_cfg, 2 * rc.batch_size, job="dpo")
    flops.bind(engine.device)
    batches = _rank_batches(len(pairs), rc.batch_size, gen, engine)

    def step_fn(step):
        pick = next(batches)
        b = pack([prompts[i] for i in pick] * 2, [pairs[i][1] for i in pick] + [pairs[i][2] for i in pick],
                 pol.pad_id)
        if rc.padding_free:
            rows = [prompts[i] + pairs[i][1] for i in pick] + [prompts[i] + pairs[i][2] for i in pick]
            lp_c, lp_r = (packed_logprobs(engine, rows) * b.mask).sum(-1).chunk(2)
        else:
            lp_c, lp_r = sequence_logprob(engine, b.ids, b.mask).chunk(2)
        loss, rc_, rr_ = fm.dpo_loss(lp_c, lp_r, ref_c[pick], ref_r[pick], rc.dpo_beta)
        engine.backward(loss)
        engine.step()
        lens = b.mask.sum(-1)
        kl = ((torch.cat([lp_c, lp_r]).detach() - torch.cat([ref_c[pick], ref_r[pick]])) / lens).mean()
        return {"loss": loss.item(), "reward": (rc_ - rr_).mean().item(), "accuracy": (rc_ > rr_).float().mean().item(),
                "kl": kl.item(), "response_length": lens.mean().item(),
                "rows": [len(prompts[i]) + len(pairs[i][k]) for k in (1, 2) for i in pick]}

    run = _loop("dpo", engine, out, rc, step_fn, batches, flops)
    return RunResult(engine, run.records, run.out, {"ref_chosen": ref_c, "ref_rejected": ref_r})
