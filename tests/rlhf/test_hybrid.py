"""The hybrid engine: after a weight sync the serving engine's greedy tokens and log-probs
equal the training module's (fp32), at stage 0 here and at stage 3 on 2 gloo ranks; and
generation leaves the training weights untouched."""

import copy

import pytest
import torch

from tests.dist_harness import run_ranks

pytestmark = pytest.mark.timeout(120)

CFG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


def tiny_llama(seed: int = 0):
    from zeal.models.llama import Llama, LlamaConfig

    torch.manual_seed(seed)
    return Llama(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def greedy_reference(model, prompt, n):
    """Greedy decoding with full forwards of a plain module; returns tokens and their log-probs."""
    ids = list(prompt)
    lps = []
    with torch.no_grad():
        for _ in range(n):
            lp = torch.log_softmax(model(torch.tensor([ids]))[0, -1].float(), -1)
            tok = int(lp.argmax())
            ids.append(tok)
            lps.append(float(lp[tok]))
    return ids[len(prompt):], lps


def _train_step(engine, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 64, (2, 12), generator=g)
    engine.backward(engine(x, x))
    engine.step()


def _check(engine, reference):
    """Sync, generate greedily and by sampling; compare with ``reference`` (a plain module
    holding the training weights). Returns the largest log-prob difference."""
    from zeal.inference.sampling_params import SamplingParams
    from zeal.rlhf.batch import pack, policy_logprobs
    from zeal.rlhf.hybrid import HybridEngine

    hybrid = HybridEngine(engine, kv_cache_bytes=1 << 20)
    before = {k: v.clone() for k, v in engine.module_state_dict().items()}
    prompts = [[1, 2, 3], [5, 9, 11, 13, 2], [7]]
    outs = hybrid.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    worst = 0.0
    for p, o in zip(prompts, outs):
        toks, lps = greedy_reference(reference, p, 8)
        assert o.output_ids == toks
        worst = max(worst, max(abs(a - b) for a, b in zip(o.logprobs, lps)))
    # sampled answers: the engine's log-probs are the training module's of the same tokens
    samp = hybrid.generate(prompts, SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=3, ignore_eos=True))
    b = pack([r.prompt_ids for r in samp], [r.output_ids for r in samp], 0, [r.logprobs for r in samp])
    with torch.no_grad():
        train_lp = policy_logprobs(reference, b.ids)
    worst = max(worst, float(((train_lp - b.logprobs) * b.mask).abs().max()))
    after = engine.module_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # generation changed no training weight
    assert hybrid.llm.is_sleeping()
    return worst


def test_hybrid_engine_matches_training_module_stage0():
    import zeal

    model = tiny_llama()
    engine = zeal.initialize(model, {**CFG, "zero_optimization": {"stage": 0}})
    _train_step(engine, 1)
    reference = copy.deepcopy(engine.module).eval()
    worst = _check(engine, reference)
    assert worst < 1e-4
    # after another step the sync brings the new weights (the old ones would not match)
    _train_step(engine, 2)
    reference.load_state_dict(engine.module_state_dict())
    assert _check(engine, reference) < 1e-4
    engine.close()


def _stage3(rank, world):
    import zeal

    engine = zeal.initialize(tiny_llama(), {**CFG, "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0}})
    _train_step(engine, 10 + rank)
    reference = tiny_llama()
    reference.load_state_dict(engine.module_state_dict())
    worst = _check(engine.eval(), reference.eval())
    engine.close()
    # a short GRPO run at stage 3: every rollout syncs the sharded weights unit by unit
    from tests.rlhf.test_e2e import PROMPTS, fraction_of_target
    from zeal.rlhf import grpo

    res = grpo(tiny_llama(), fraction_of_target, PROMPTS, {
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "rlhf": {"steps": 2, "batch_size": 2, "num_generations": 2, "max_new_tokens": 4, "generation_dtype": "fp32"}})
    res.engine.close()
    return max([worst] + [r["logprob_diff"] for r in res.metrics])


@pytest.mark.timeout(180)
def test_hybrid_engine_matches_training_module_stage3_two_ranks():
    worst = run_ranks(_stage3, 2, timeout=170)
    assert max(worst) < 1e-4
