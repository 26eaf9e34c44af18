"""The default job's final sample (``zeal.train.job.sample``): the same tokens as a plain
greedy loop over a growing context, and every forward one shape (a forward per new
length grew each rank's RSS by ~3 MiB per length on CPU: +145 MiB, the job's peak)."""

from __future__ import annotations

import pytest
import torch

import zeal
from zeal.models import GPT, GPTConfig
from zeal.train.job import sample

pytestmark = pytest.mark.timeout(120)


class _Ids:
    """A stand-in tokenizer: the prompt is given as token ids."""

    def __init__(self, ids):
        self.ids = ids

    def encode(self, _prompt):
        return self

    def decode(self, ids):
        return ids


def _engine(bf16: bool, vocab: int, positions: int):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, n_positions=positions, n_embd=32, n_layer=2, n_head=4))
    return model, zeal.initialize(model, {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": bf16},
                                          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})


def test_sample_matches_a_plain_greedy_loop_past_the_window():
    model, engine = _engine(False, 64, 16)
    got = sample(engine, _Ids([5, 9, 3]), "", 30, 0.0, 0, 16, 0)
    ids = torch.tensor([[5, 9, 3]])
    with torch.no_grad():
        for _ in range(30):
            nxt = model(ids[:, -16:])[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
    assert got == ids[0].tolist()


def test_sample_forwards_have_one_shape():
    _, engine = _engine(True, 4096, 128)
    shapes = set()
    handle = engine.module.register_forward_pre_hook(
        lambda _m, args, kw: shapes.add(tuple((args[0] if args else kw["input_ids"]).shape)), with_kwargs=True)
    try:
        sample(engine, _Ids([1, 2, 3]), "", 24, 0.8, 40, 128, 0)
    finally:
        handle.remove()

    def rss_mib() -> float:
        return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

    before = rss_mib()
    sample(engine, _Ids([1, 2, 3]), "", 48, 0.8, 40, 128, 1)
    assert shapes == {(1, 128)}
    assert rss_mib() - before < 40  # the old growing context: ~150 MiB over 48 new lengths here


def test_llama_sample_uses_a_kv_cache_and_matches_a_plain_greedy_loop():
    """zeal's Llama (the default job's SmolLM2) samples one token per forward with its keys
    and values cached (zeal.train.cached_sample): the same tokens as a plain greedy loop over
    the whole growing context, and no forward longer than the prompt."""
    from zeal.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    engine = zeal.initialize(model, {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                                     "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    lengths = []
    handle = engine.module.register_forward_pre_hook(
        lambda _m, args, kw: lengths.append((args[0] if args else kw["input_ids"]).shape[-1]), with_kwargs=True)
    try:
        got = sample(engine, _Ids([5, 9, 3]), "", 20, 0.0, 0, 16, 0)
    finally:
        handle.remove()
    assert lengths == [3] + [1] * 19
    ids = torch.tensor([[5, 9, 3]])
    with torch.no_grad(), engine.gathered_parameters():
        for _ in range(20):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], 1)
    assert got == ids[0].tolist()
