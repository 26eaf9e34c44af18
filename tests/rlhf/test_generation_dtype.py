"""Generating rollouts from a bf16 copy of an fp32 actor (``rlhf.generation_dtype``): the
engine's log-probs of its sampled tokens are the training side's to bf16 rounding (a stated
tolerance) while the fp32 copy stays exact; the training side's behaviour log-probs then
give GRPO the same update as exact engine log-probs would; the answer-only LM-head
projection equals the full one (values and gradients)."""

import copy

import pytest
import torch

from tests.rlhf.test_hybrid import CFG, tiny_llama

pytestmark = pytest.mark.timeout(60)

# |engine bf16 log-prob − training fp32 log-prob| of a sampled token, tiny Llama (hidden 32,
# vocab 64): measured ≤ 0.02 here; bf16 keeps 8 mantissa bits (relative rounding 2^-9 per
# weight), so the logits move by a few hundredths at most
BF16_TOL = 0.1
FP32_TOL = 1e-4


def _sampled_gap(dtype):
    """Train one step, generate by sampling from a serving copy in ``dtype``; the largest
    |engine − training| log-prob over the sampled tokens, and the hybrid engine."""
    import zeal
    from zeal.inference.sampling_params import SamplingParams
    from zeal.rlhf.batch import pack, policy_logprobs
    from zeal.rlhf.hybrid import HybridEngine

    engine = zeal.initialize(tiny_llama(), {**CFG, "zero_optimization": {"stage": 0}})
    x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    engine.backward(engine(x, x))
    engine.step()
    hybrid = HybridEngine(engine, kv_cache_bytes=1 << 20, dtype=dtype)
    prompts = [[1, 2, 3], [5, 9, 11, 13, 2], [7]]
    outs = hybrid.generate(prompts, SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=3, ignore_eos=True))
    b = pack([r.prompt_ids for r in outs], [r.output_ids for r in outs], 0, [r.logprobs for r in outs])
    reference = copy.deepcopy(engine.module).eval()
    with torch.no_grad():
        train_lp = policy_logprobs(reference, b.ids)
    gap = float(((train_lp - b.logprobs).abs() * b.mask).max())
    engine.close()
    return gap, hybrid


def test_bf16_generation_logprobs_close_fp32_exact():
    gap16, h16 = _sampled_gap(torch.bfloat16)
    gap32, h32 = _sampled_gap(torch.float32)
    assert next(h16.llm.engine.runner.model.parameters()).dtype == torch.bfloat16
    assert not h16.exact_logprobs and h32.exact_logprobs
    assert gap32 < FP32_TOL
    assert 0.0 < gap16 < BF16_TOL  # not exact (it really ran in bf16), but close


def test_generation_dtype_setting(monkeypatch):
    from zeal.config import ConfigError
    from zeal.rlhf.config import split_config
    from zeal.rlhf.hybrid import generation_dtype
    from zeal.utils import hardware

    assert generation_dtype("fp32", torch.float32, "cpu") == torch.float32
    assert generation_dtype("bf16", torch.float32, "cpu") == torch.bfloat16
    monkeypatch.setattr(hardware, "native_bf16", lambda device=None: True)
    assert generation_dtype("auto", torch.float32, "cpu") == torch.bfloat16
    assert generation_dtype("auto", torch.float16, "cpu") == torch.float16  # a 16-bit actor stays as it is
    monkeypatch.setattr(hardware, "native_bf16", lambda device=None: False)
    assert generation_dtype("auto", torch.float32, "cpu") == torch.float32
    assert split_config({"rlhf": {"generation_dtype": "bf16"}})[1].generation_dtype == "bf16"
    with pytest.raises(ConfigError, match="generation_dtype"):
        split_config({"rlhf": {"generation_dtype": "fp16"}})


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_answer_logprobs_equal_full_projection(arch):
    from zeal.models.gpt import GPT, GPTConfig
    from zeal.rlhf.batch import answer_logprobs, policy_logprobs

    torch.manual_seed(0)
    model = tiny_llama() if arch == "llama" else GPT(GPTConfig(vocab_size=64, n_positions=32, n_embd=32, n_layer=2,
                                                               n_head=4))
    ids = torch.randint(0, 64, (3, 11))
    full = policy_logprobs(model, ids)
    full[:, 4:].sum().backward()
    g_full = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    part = answer_logprobs(model, ids, 4)
    part.sum().backward()
    assert part.shape == (3, 6)
    torch.testing.assert_close(part, full[:, 4:], rtol=0, atol=1e-6)
    for a, p in zip(g_full, model.parameters()):
        torch.testing.assert_close(p.grad, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("epochs,share", [(1, True), (2, True), (1, False)])
def test_grpo_update_with_training_side_behaviour_logprobs(epochs, share):
    """GRPO on the same rollouts: behaviour log-probs from the training side (a bf16 engine's
    are not exact) give the weights that exact engine log-probs (the training module's own,
    here) give; with 2 epochs they come from a no-grad pass before the first update. With
    ``share_prompt`` the prompt-once forwards give the full rows' log-probs (gap ~0)."""
    import zeal
    from zeal.rlhf.batch import pack, policy_logprobs
    from zeal.rlhf.config import RLHFConfig
    from zeal.rlhf.grpo_trainer import _train_on
    from zeal.rlhf.hybrid import Rollout

    g = torch.Generator().manual_seed(5)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    rollouts = [Rollout(p, torch.randint(0, 64, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist(),
                        [], group=k) for k, p in enumerate(prompts) for _ in range(2)]
    model = tiny_llama()
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    b = pack([r.prompt_ids for r in rollouts], [r.output_ids for r in rollouts], 0)
    with torch.no_grad():
        lp = policy_logprobs(model, b.ids)
    rc = RLHFConfig(num_generations=2, ppo_epochs=epochs, beta=0.04, share_prompt=share,
                    importance_sampling_correction=False)  # the behaviour side only; weights: test_grpo_family
    cfg = {**CFG, "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 0}}
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    runs = []
    for exact in (True, False):
        for r, row, m in zip(rollouts, lp, b.mask):  # exact: the engine's are the training module's
            r.logprobs = row[m.bool()].tolist() if exact else [x - 0.05 for x in row[m.bool()].tolist()]
        engine = zeal.initialize(copy.deepcopy(model), cfg)
        stats = _train_on(engine, ref, rollouts, rewards, 0, rc, exact=exact)
        runs.append((stats, engine.module_state_dict()))
        engine.close()
    (s_exact, w_exact), (s_train, w_train) = runs
    assert abs(s_exact["loss"] - s_train["loss"]) < 1e-6
    assert s_exact["logprob_diff"] < 1e-5 and abs(s_train["logprob_diff"] - 0.05) < 1e-4
    for k in w_exact:
        torch.testing.assert_close(w_train[k], w_exact[k], rtol=0, atol=1e-6)


def test_ppo_update_with_training_side_behaviour_logprobs():
    """PPO on the same rollout batch: behaviour log-probs taken from the training side's
    first forward (not exact engine) give the update exact engine log-probs give."""
    import zeal
    from zeal.rlhf.batch import pack, policy_logprobs
    from zeal.rlhf.config import RLHFConfig
    from zeal.rlhf.ppo_trainer import ppo_update
    from zeal.rlhf.value import ValueModel

    g = torch.Generator().manual_seed(7)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8], [9, 10]]
    answers = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (3, 5, 2, 4)]
    model = tiny_llama()
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    b0 = pack(prompts, answers, 0)
    with torch.no_grad():
        lp = policy_logprobs(model, b0.ids)
    rc = RLHFConfig(ppo_epochs=2, kl_coef=0.1)
    cfg = {**CFG, "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 0}}
    scores = torch.tensor([1.0, -0.5, 0.2, 0.0])
    runs = []
    for exact in (True, False):
        served = [row[m.bool()].tolist() if exact else [0.0] * int(m.sum()) for row, m in zip(lp, b0.mask)]
        b = pack(prompts, answers, 0, served)
        actor = zeal.initialize(copy.deepcopy(model), cfg)
        critic = zeal.initialize(ValueModel.from_lm(model), cfg)
        stats = ppo_update(actor, critic, ref, b, scores, rc, None, 0, None, exact=exact)
        runs.append((stats, actor.module_state_dict()))
        actor.close()
        critic.close()
    (s1, w1), (s2, w2) = runs
    assert abs(s1["loss"] - s2["loss"]) < 1e-6 and abs(s1["kl"] - s2["kl"]) < 1e-6
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=1e-6)
