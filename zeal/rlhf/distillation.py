"""On-policy distillation: the student samples answers with the hybrid engine, a frozen
teacher scores every sampled token, and the student is trained to lower the reverse KL
``KL(π_student ‖ π_teacher)`` on its own samples.

The per-token reverse KL estimate ``k_t = log π_s(y_t) − log π_t(y_t)`` (``y_t`` sampled by
the student) is the negative per-token advantage of a policy-gradient step:
``A_t = −k_t`` (detached), with the clipped ratio of :mod:`zeal.rlhf.grpo_losses`
(``bnpo`` aggregation: mean over the answer tokens). Its expected gradient is the
per-token reverse KL's (each token's term, without the later tokens' dependence on it:
discount 0). The teacher is any module with the student's vocabulary (zeal ``Llama``/``GPT``
or a Hugging Face folder), evaluated without grad on the training side.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from zeal.inference.sampling_params import SamplingParams
from zeal.rlhf import grpo_losses as gl
from zeal.rlhf.batch import answer_logprobs, pack
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
from zeal.rlhf.hybrid import HybridEngine, generation_dtype


def reverse_kl_advantages(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                          mask: torch.Tensor) -> torch.Tensor:
    """Per-token advantages ``−(log π_s − log π_t)`` on the answer tokens (0 elsewhere), no grad."""
    return -(student_logprobs.detach() - teacher_logprobs.detach()) * mask


def distill(student: Any, teacher: Any, prompts: Sequence[Any], config: Any = None, *, tokenizer: Any = None,
            out: str | None = None, eos_token_ids: list[int] | None = None) -> RunResult:
    """Train ``student`` on ``teacher``'s log-probs over the student's own rollouts (reverse
    KL, see the module docstring); ``config`` as for :func:`zeal.rlhf.grpo` (``rlhf``:
    ``steps``, ``batch_size`` prompts × ``num_generations`` answers, ``max_new_tokens``,
    ``temperature``, ``clip``). Logs ``reverse_kl`` per step (mean over answer tokens)."""
    engine_cfg, rc = split_config(config)
    gen = set_seed(rc.seed)
    pol = load_policy(student, tokenizer, eos_token_ids, job="distill")
    disable_dropout(pol.model)
    t = load_policy(teacher, None, None, job="distill")
    teach = frozen_copy(t.model)
    prompt_ids = [encode_prompt(p, pol.tokenizer, rc) for p in prompts]
    G, P = rc.num_generations, rc.batch_size
    engine = build_engine(pol.model, engine_cfg, P * G, job="distill")
    hybrid = HybridEngine(engine, pol.tokenizer, eos_token_ids=pol.eos_ids, kv_cache_bytes=rc.kv_cache_bytes,
                          dtype=generation_dtype(rc.generation_dtype, next(engine.module.parameters()).dtype,
                                                 engine.device))
    run = RunLog(out, engine.rank, "distill", rc, engine.mesh.dp)
    r, world = dp_slice(engine)
    gen.manual_seed(rc.seed * 1000003)
    say("distill", f"{rc.steps} steps: {G} answers to each of {P * world} prompts, scored by the teacher")
    for step in range(1, rc.steps + 1):
        pick = torch.randint(len(prompt_ids), (P * world,), generator=gen)[r * P:(r + 1) * P].tolist()
        params = SamplingParams(n=G, max_tokens=rc.max_new_tokens, temperature=rc.temperature, top_p=rc.top_p,
                                seed=sampling_seed(rc.seed, step) + r * P * G, logprobs=0)
        ros = hybrid.generate([prompt_ids[i] for i in pick], params, reload_next=True)  # next step syncs
        b = pack([x.prompt_ids for x in ros], [x.output_ids for x in ros], pol.pad_id)
        s0 = min(len(x.prompt_ids) for x in ros) - 1
        mask = b.mask[:, s0:]
        with torch.no_grad():
            lp_t = answer_logprobs(teach, b.ids, s0)
        engine.train()
        lp = answer_logprobs(engine, b.ids, s0)
        adv = reverse_kl_advantages(lp, lp_t, mask)
        loss, _ = gl.policy_loss(lp, lp.detach(), adv, mask, loss_type="bnpo", eps_low=rc.clip,
                                 eps_high=rc.clip_high)
        engine.backward(loss)
        engine.step()
        rkl = float((-adv).sum() / mask.sum().clamp(min=1.0))
        run.log(step, loss=loss.item(), reverse_kl=rkl, response_length=mask.sum(-1).mean().item())
        run.checkpoint(engine, step, final=step == rc.steps)
    run.close()
    return RunResult(engine, run.records, run.out, {"hybrid": hybrid})
