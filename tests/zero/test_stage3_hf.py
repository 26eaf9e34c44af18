"""Stage 3 on a Hugging Face model: gradient checkpointing of either kind, and
``generate()`` from the engine's module, against plain single-process PyTorch.

Tolerance as in ``test_stage3_any_model``: fp32 losses to 1e-5 relative (reduction
order differs by a few ulps); greedy tokens must be equal."""

from __future__ import annotations

import pytest
import torch

from tests.dist_harness import RankPool

pytest.importorskip("transformers")

STEPS, MICRO, SEQ, LR, WORLD, VOCAB = 3, 2, 12, 1e-2, 2, 67


def _model(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tied, attn_implementation="eager")
    return LlamaForCausalLM(cfg)


def _data():
    g = torch.Generator().manual_seed(5)
    return [[torch.randint(0, VOCAB, (MICRO, SEQ), generator=g) for _ in range(WORLD)] for _ in range(STEPS)]


PROMPT = torch.tensor([[3, 14, 15, 9, 26]])


def plain_losses(model) -> list[float]:
    """One plain-PyTorch process training ``model`` on the whole batch of every step."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for per_rank in _data():
        ids = torch.cat(per_rank)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _reference(tied: bool, reentrant: bool | None):
    model = _model(tied)
    if reentrant is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    losses = plain_losses(model)
    model.eval()
    with torch.no_grad():
        out = model.generate(PROMPT, max_new_tokens=6, do_sample=False, pad_token_id=0)
    return losses, out[0].tolist()


def _train(rank, world, tied, reentrant):
    import zeal

    model = _model(tied)
    if reentrant is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    engine = zeal.initialize(model, {
        "train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    engine.train()
    losses = []
    for per_rank in _data():
        ids = per_rank[rank]
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out)
        engine.step()
        losses.append(out.loss.item())
    engine.eval()
    with torch.no_grad():
        tokens = engine.module.generate(PROMPT, max_new_tokens=6, do_sample=False, pad_token_id=0)
    engine.close()
    return losses, tokens[0].tolist()


@pytest.fixture(scope="module")
def pool():
    p = RankPool(WORLD)
    yield p
    p.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tied,reentrant", [(True, False), (True, True), (False, False), (True, None)],
                         ids=["tied-nonreentrant", "tied-reentrant", "untied-nonreentrant", "tied-plain"])
def test_hf_llama_stage3_matches_plain_pytorch(pool, tied, reentrant):
    want_losses, want_tokens = _reference(tied, reentrant)
    results = pool.run(_train, tied, reentrant, timeout=150)
    got = [sum(r[0][i] for r in results) / WORLD for i in range(STEPS)]
    for i, (g, w) in enumerate(zip(got, want_losses)):
        assert abs(g - w) <= 1e-5 * abs(w), f"step {i}: {got} vs {want_losses}"
    for _, tokens in results:
        assert tokens == want_tokens
