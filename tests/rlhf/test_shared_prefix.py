"""GRPO's prompt-once forwards (:mod:`zeal.rlhf.shared_prefix`) against full rows: the
answer tokens' log-probs and the parameter gradients of a loss on them equal those of
``policy_logprobs`` over ``prompt + answer`` rows (prompts of different lengths, answers
of different lengths, Llama with grouped KV heads and GPT)."""

import pytest
import torch

pytestmark = pytest.mark.timeout(60)


def _model(arch):
    from zeal.models.gpt import GPT, GPTConfig
    from zeal.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    if arch == "gpt":
        return GPT(GPTConfig(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4))
    return Llama(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_prompt_once_equals_full_rows(arch):
    from zeal.rlhf.batch import pack, policy_logprobs
    from zeal.rlhf.hybrid import Rollout
    from zeal.rlhf.shared_prefix import answer_batch, can_share, rollout_logprobs

    model = _model(arch)
    assert can_share(model)
    g = torch.Generator().manual_seed(3)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
    rollouts = [Rollout(p, torch.randint(0, 64, (n,), generator=g).tolist(), [], group=k)
                for k, p in enumerate(prompts) for n in (1, 4, 7)]
    w = torch.rand(len(rollouts), 7, generator=g)
    # reference: full rows, the answer actions picked out of the packed layout
    b = pack([r.prompt_ids for r in rollouts], [r.output_ids for r in rollouts], 0)
    full = policy_logprobs(model, b.ids)
    ref = torch.zeros(len(rollouts), 7)
    for i, r in enumerate(rollouts):
        s = len(r.prompt_ids) - 1
        ref[i, : len(r.output_ids)] = full[i, s : s + len(r.output_ids)]
    answers, mask, _ = answer_batch(rollouts, 0)
    (ref * w * mask).sum().backward()
    g_ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    got = rollout_logprobs(model, rollouts, answers, 0)
    (got * w * mask).sum().backward()
    torch.testing.assert_close(got * mask, ref * mask, rtol=0, atol=2e-6)
    for a, p in zip(g_ref, model.parameters()):
        torch.testing.assert_close(p.grad, a, rtol=1e-4, atol=1e-6)


def test_not_shared_under_checkpointing_or_stage3():
    import zeal
    from zeal.rlhf.shared_prefix import can_share

    model = _model("llama")
    model.checkpoint_policy.enabled = True
    assert not can_share(model)
    model.checkpoint_policy.enabled = False
    engine = zeal.initialize(model, {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
                                     "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert can_share(engine)
    engine.close()
    assert not can_share(torch.nn.Linear(2, 2))
