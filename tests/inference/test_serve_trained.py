"""A model trained by zeal is served from the very module objects that trained: the
engine calls the model's own layer modules (through ``__call__``, so forward hooks,
ZeRO-3's gather/release included, fire) with paged attention passed in.

Greedy tokens must be equal: the references run the same fp32 weights (HF
``generate``, or the model's own dense forward), and the random models below have
logit gaps far above the few-ulp differences between the paged and dense paths.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import zeal
from tests.inference.conftest import VOCAB, hf_greedy, mixed_prompts
from zeal.inference import LLM, SamplingParams
from zeal.models import GPT, GPTConfig
from zeal.models.llama import Llama, LlamaConfig

NEW = 8
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
GPT_CFG = GPTConfig(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4)
LLAMA_CFG = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        initializer_range=0.08)


def _count_layer_calls(layers) -> Counter:
    calls: Counter = Counter()
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda _m, _a, i=i: calls.update([i]))
    return calls


def _batches(n: int, vocab: int, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (2, 16), generator=g) for _ in range(n)]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _dense_greedy(model, prompts):
    return [model.generate(torch.tensor([p]), NEW, temperature=0)[0, len(p):].tolist() for p in prompts]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_trained_zeal_llama_serves_hf_greedy_tokens(tmp_path, kernels, tied):
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**{**LLAMA_CFG.__dict__, "tie_word_embeddings": tied}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for ids in _batches(3, VOCAB):
        model(ids, labels=ids).backward()
        opt.step()
        opt.zero_grad()
    calls = _count_layer_calls(model.model.layers)
    llm = LLM(model, block_size=4, num_blocks=64)
    assert llm.engine.runner.model is model  # no wrapper, no copy
    prompts = mixed_prompts(4, 4, 1, 20)
    got = _tokens(llm.generate(prompts, GREEDY))
    assert calls[0] > 0 and calls[0] == calls[1]  # every pass went through the layer modules
    assert got == hf_greedy(model.save_hf_folder(tmp_path / "hf"), prompts, NEW)


@pytest.mark.timeout(120)
def test_gpt_trained_by_zeal_serves_its_dense_greedy_tokens_and_sees_new_steps(kernels):
    torch.manual_seed(0)
    engine = zeal.initialize(GPT(GPT_CFG), {"train_micro_batch_size_per_gpu": 2, "optimizer": {
        "type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 1}})
    batches = _batches(3, VOCAB)

    def step(ids):
        engine.train()
        loss = engine(ids, labels=ids)
        engine.backward(loss)
        engine.step()

    step(batches[0])
    step(batches[1])
    model, prompts = engine.module, mixed_prompts(5, 3, 1, 20)
    calls = _count_layer_calls(model.transformer.h)
    llm = LLM(model, block_size=4, num_blocks=64, enable_prefix_caching=False)
    got = _tokens(llm.generate(prompts, GREEDY))
    assert calls[0] > 0 and calls[0] == calls[1]
    assert got == _dense_greedy(model.eval(), prompts)
    step(batches[2])  # the engine serves the weights in place: the next step is seen at once
    assert _tokens(llm.generate(prompts, GREEDY)) == _dense_greedy(model.eval(), prompts)
    engine.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_stage3_engine_module_is_served_with_its_hooks(kernels, family):
    """World size 1: every unit is partitioned (persistence 0), so a layer's weights exist
    only while its ZeRO-3 pre-hook holds them; tokens equal to the dense forward's show
    that the hooks gathered them, and empty storage afterwards that they released."""
    torch.manual_seed(0)
    model = GPT(GPT_CFG) if family == "gpt" else Llama(LLAMA_CFG)
    engine = zeal.initialize(model, {"train_micro_batch_size_per_gpu": 2, "optimizer": {
        "type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {
            "stage": 3, "stage3_param_persistence_threshold": 0}})
    for ids in _batches(2, VOCAB):
        loss = engine(ids, labels=ids)
        engine.backward(loss)
        engine.step()
    engine.eval()
    model, prompts = engine.module, mixed_prompts(6, 3, 1, 20)
    layers = model.layer_stack()
    weight = next(layers[0].parameters())
    assert weight.untyped_storage().size() == 0  # released between uses
    want = _dense_greedy(model, prompts)
    llm = LLM(model, block_size=4, num_blocks=64)
    assert _tokens(llm.generate(prompts, GREEDY)) == want
    assert weight.untyped_storage().size() == 0
    engine.close()
