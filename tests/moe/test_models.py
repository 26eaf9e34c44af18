"""zeal's GPT and Llama with an MoE MLP every ``moe_every`` blocks: shapes, the aux loss
in the LM loss, no capacity dropping in eval/serving, and training through initialize."""

from __future__ import annotations

import pytest
import torch

from zeal.models import GPT, GPTConfig
from zeal.models.llama import Llama, LlamaConfig
from zeal.models.moe_mlp import MoEMLP, moe_aux_loss


def _gpt(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=61, n_positions=16, n_embd=16, n_layer=4, n_head=2, num_experts=4, **kw))


def _llama(**kw) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=61, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                             num_experts=4, moe_every=1, **kw))


def test_moe_blocks_and_parameter_count():
    m = _gpt(top_k=2)
    kinds = [isinstance(b.mlp, MoEMLP) for b in m.transformer.h]
    assert kinds == [False, True, False, True]  # every other block, the second first
    assert sum(p.numel() for p in m.parameters()) == m.config.num_parameters()
    with pytest.raises(ValueError, match="num_experts 4 is not divisible by ep_size 3"):
        _gpt(ep_size=3)


@pytest.mark.parametrize("make", [_gpt, _llama])
def test_aux_loss_is_added_with_its_coefficient(make):
    x = torch.randint(0, 61, (2, 12))
    m = make(aux_loss_coef=0.0, top_k=2)
    torch.manual_seed(1)
    base = m(x, x)
    aux = moe_aux_loss(m)
    m.config.aux_loss_coef = 0.25
    torch.manual_seed(1)
    total = m(x, x)
    assert float(total) == pytest.approx(float(base) + 0.25 * float(aux), rel=1e-6)
    total.backward()
    gate = next(mod for mod in m.modules() if isinstance(mod, MoEMLP)).moe.deepspeed_moe.gate.wg.weight
    assert gate.grad is not None and gate.grad.abs().sum() > 0


@pytest.mark.parametrize("make", [_gpt, _llama])
def test_eval_routes_every_token_like_one_at_a_time(make):
    # capacity factor 0.25 would drop most tokens in training; eval drops none, so a batch
    # gives each sequence the logits it gets alone
    m = make(capacity_factor=0.25, top_k=2).eval()
    x = torch.randint(0, 61, (3, 10))
    with torch.no_grad():
        batch = m(x)
        alone = torch.cat([m(x[i:i + 1]) for i in range(3)])
    torch.testing.assert_close(batch, alone, rtol=1e-5, atol=1e-5)
    m.train()
    with torch.no_grad():
        assert not torch.allclose(m(x), batch, atol=1e-3)  # training capacity drops tokens


@pytest.mark.parametrize("make", [_gpt, _llama])
def test_dropless_training_routes_as_eval(make):
    """``drop_tokens=False``: no capacity and no routing noise in training either, so a
    training forward (no dropout) gives the eval logits even at capacity factor 0.25."""
    m = make(capacity_factor=0.25, top_k=2, drop_tokens=False)
    x = torch.randint(0, 61, (3, 10))
    with torch.no_grad():
        train = m.train()(x)
        evals = m.eval()(x)
    torch.testing.assert_close(train, evals, rtol=1e-5, atol=1e-5)


def test_gpt_moe_trains_through_initialize():
    import zeal
    from zeal.config.job import JobSpec
    from zeal.train.job import build_model

    spec = JobSpec.model_validate({"model": {"n_layer": 2, "n_embd": 16, "n_head": 2, "num_experts": 4, "top_k": 2},
                                   "data": {"seq_len": 16}, "job": {"hf_model": "gpt"}})
    factory = build_model(spec, 61)  # zeal train's model: built on the meta device, materialised by ZeRO
    engine = zeal.initialize(factory, {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
                                 "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}})
    torch.manual_seed(5)
    x = torch.randint(0, 61, (2, 12))
    losses = []
    assert sum(isinstance(mod, MoEMLP) for mod in engine.module.modules()) == 1
    for _ in range(8):
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.1
    engine.close()


def test_checkpoint_resumes_at_stage_2_and_at_stage_3(tmp_path):
    import zeal
    from tests.moe.models import TinyMoENet, batches

    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    torch.manual_seed(0)
    engine = zeal.initialize(TinyMoENet(), cfg)
    data = batches(3, 1)
    for step in data[:2]:
        engine.backward(engine(*step[0]))
        engine.step()
    engine.save_checkpoint(str(tmp_path))
    with torch.no_grad():
        expected = float(engine(*data[2][0]))
    torch.manual_seed(1)
    other = zeal.initialize(TinyMoENet(), cfg)
    other.load_checkpoint(str(tmp_path))
    with torch.no_grad():
        assert float(other(*data[2][0])) == expected
    torch.manual_seed(2)
    third = zeal.initialize(TinyMoENet(), {**cfg, "zero_optimization": {"stage": 3}})  # experts partitioned too
    third.load_checkpoint(str(tmp_path))
    with torch.no_grad():
        assert float(third(*data[2][0])) == pytest.approx(expected, rel=1e-6)
