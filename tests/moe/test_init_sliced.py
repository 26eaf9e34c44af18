"""A model whose MoE layers keep only this rank's experts at construction (built after
``init_process_group`` with ep_size > 1) initialises as one process does: every expert it
keeps and every module after the MoE layers equal the single-process model's under the
same seed. Before, the weight init skipped the absent experts' random draws, so rank 0's
``lm_head`` and rank 1's experts differed from one process (SP 2 × EP 2 was 0.8% off one
process at step 0 because of it)."""

from __future__ import annotations

import pytest
import torch


def _build(kind: str, ep: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        from zeal.models.llama import Llama, LlamaConfig

        return Llama(LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, num_experts=4, moe_every=2,
                                 top_k=1, ep_size=ep))
    from zeal.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=48, n_positions=16, n_embd=32, n_layer=2, n_head=4, num_experts=4,
                         moe_every=1, ep_size=ep))


@pytest.mark.parametrize("kind", ["llama", "gpt"])
@pytest.mark.parametrize("rank", [0, 1])
def test_experts_sliced_at_build_initialise_as_one_process(monkeypatch, kind, rank):
    ref = _build(kind, 1).state_dict()
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)  # built "after init_process_group"
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: rank)
    got = _build(kind, 2).state_dict()
    assert len(got) < len(ref)  # the other rank's experts are gone
    assert any(f"deepspeed_experts.{2 * rank}." in k for k in got)
    for name, t in got.items():
        assert torch.equal(t, ref[name]), name
