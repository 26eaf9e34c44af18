"""Hugging Face Qwen2-MoE and OLMoE folders (tiny models from a config, saved with
``save_pretrained``) load as zeal Llama models: eval logits and the training-path loss
(train mode, dropless routing) equal HF's, with the router and shared-expert-gate
gradients; ``zeal serve``'s LLM (routing per token batch, no capacity dropping) gives
HF ``generate``'s greedy tokens; keys zeal cannot express are refused by name."""

from __future__ import annotations

import pytest
import torch

VOCAB = 64


def _qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    # top-3 of 6 experts without renormalisation, a shared expert, layer 1 dense, layer 2 MoE
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        shared_expert_intermediate_size=40, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        num_experts=6, num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1],
        max_position_embeddings=128, initializer_range=0.1, eos_token_id=1, bos_token_id=None, pad_token_id=None))


def _olmoe():
    from transformers import OlmoeConfig, OlmoeForCausalLM

    # q/k norms, clip_qkv reached by the larger init, renormalised top-3 of 6
    return OlmoeForCausalLM(OlmoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=6, num_experts_per_tok=3, norm_topk_prob=True, clip_qkv=0.6,
        max_position_embeddings=128, initializer_range=0.2, eos_token_id=1, bos_token_id=None, pad_token_id=0))


FORMATS = {"qwen2_moe": _qwen2_moe, "olmoe": _olmoe}
# zeal name -> HF name of tensors whose gradients are compared (the router, the shared expert's gate)
GRADS = {"qwen2_moe": {"model.layers.0.mlp.moe.deepspeed_moe.gate.wg.weight": "model.layers.0.mlp.gate.weight",
                       "model.layers.2.mlp.shared_expert_gate.weight": "model.layers.2.mlp.shared_expert_gate.weight",
                       "model.layers.1.mlp.up_proj.weight": "model.layers.1.mlp.up_proj.weight"},
         "olmoe": {"model.layers.1.mlp.moe.deepspeed_moe.gate.wg.weight": "model.layers.1.mlp.gate.weight",
                   "model.layers.0.self_attn.q_norm.weight": "model.layers.0.self_attn.q_norm.weight"}}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_hf_moe_logits_loss_and_serving_equal_hf(fmt, tmp_path, monkeypatch):
    from zeal.inference import LLM, SamplingParams
    from zeal.models.hf import load_hf_model

    torch.manual_seed(0)
    hf = FORMATS[fmt]().eval()
    hf.save_pretrained(tmp_path)
    x = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    model, _ = load_hf_model(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, rtol=1e-4, atol=1e-5)

    model.train()  # the training path: dropless routing, the aux loss off as in HF's loss
    hf.train()
    loss, ref = model(x, labels=x), hf(x, labels=x).loss
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    loss.backward()
    ref.backward()
    ours, theirs = dict(model.named_parameters()), dict(hf.named_parameters())
    for name, hf_name in GRADS[fmt].items():
        torch.testing.assert_close(ours[name].grad, theirs[hf_name].grad, rtol=1e-4, atol=1e-6, msg=name)
    hf.eval()

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (3, 9, 17, 5)]
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    monkeypatch.setattr("zeal.inference.model_runner.cpu_kernels", lambda: None)  # the pure-torch path
    llm = LLM(str(tmp_path), block_size=4, num_blocks=128, max_num_batched_tokens=64)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == want


def test_hf_moe_config_keys_zeal_cannot_express_are_refused_by_name():
    from zeal.models.hf_moe import mixtral_config_to_hf, moe_config

    base = {"model_type": "qwen2_moe", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16}
    cfg = moe_config(base)
    assert (cfg.num_experts, cfg.top_k, cfg.norm_topk_prob, cfg.drop_tokens, cfg.aux_loss_coef) == (4, 2, False, False, 0.0)
    assert moe_config({**base, "output_router_logits": True}).aux_loss_coef == 0.001
    for bad, key in (({"use_sliding_window": True}, "use_sliding_window"), ({"hidden_act": "gelu"}, "hidden_act"),
                     ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types")):
        with pytest.raises(ValueError, match=f"qwen2_moe config key {key}"):
            moe_config({**base, **bad})
    with pytest.raises(ValueError, match="no Mixtral layout"):  # its shared expert would be lost
        mixtral_config_to_hf(cfg)


def test_topk_gating_hand_worked_example():
    """k = 3 of 4 experts, 3 tokens, capacity ceil(3/4 · 0.5 · 3) = 2: choice j of an
    expert queues after every choice < j, so expert 2 takes t1's and t2's second
    choices and drops t0's third; weights renormalised over the kept choices."""
    import torch.nn.functional as F

    from zeal.moe.gating import topkgating

    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 3.0, 2.0, 1.0], [3.0, 0.0, 2.0, 1.0]])
    p = F.softmax(logits, dim=1)
    r = topkgating(logits, 3, capacity_factor=0.5, min_capacity=1)
    assert r.capacity == 2
    assert r.experts.tolist() == [[0, 1, 0], [1, 2, 2], [2, 3, 3]]
    assert r.kept.tolist() == [[True, True, True], [True, True, True], [False, True, True]]
    assert r.slots[r.kept].tolist() == [0, 0, 1, 1, 0, 1, 0, 1]  # (choice, token) order, kept only
    assert r.exp_counts.tolist() == [2, 2, 3, 2]  # every choice, before dropping
    t0 = p[0, :2] / p[0, :2].sum()
    torch.testing.assert_close(r.gates[:, 0], torch.stack([t0[0], t0[1], torch.tensor(0.0)]))
    torch.testing.assert_close(r.gates[:, 1], p[1, [1, 2, 3]] / p[1, [1, 2, 3]].sum())
    torch.testing.assert_close(r.l_aux, 4 * (p.mean(0) * torch.tensor([2.0, 2, 3, 2]) / 9).sum())
    raw = topkgating(logits, 3, capacity_factor=0.5, min_capacity=1, normalize=False)
    torch.testing.assert_close(raw.gates[:, 1], p[1, [1, 2, 3]])  # Qwen2-MoE / OLMoE default
    assert topkgating(logits, 3, 0.5, 1, drop_tokens=False).kept.all()  # dropless: capacity = largest count
