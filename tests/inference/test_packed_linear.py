"""fp32 serving on oneDNN-packed weights (``zeal.inference.packed_linear``): the same
logits as the plain ``F.linear`` path to fp32 rounding, the same greedy tokens, a row's
output independent of how many rows share its pass, weights changed in place re-packed,
and the served module left training through ``F.linear`` afterwards."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zeal.inference import LLM, SamplingParams
from zeal.inference.packed_linear import PackedLinears, packed_linears_for
from zeal.models import GPT, GPTConfig

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(packed_linears_for(nn.Sequential(nn.Linear(2, 2)), torch.device("cpu"),
                                                    torch.float32) is None, reason="no oneDNN in this torch")]
CFG = GPTConfig(vocab_size=96, n_positions=64, n_embd=64, n_layer=2, n_head=2)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [list(range(1, 12)), [5, 9, 2, 7], list(range(20, 45))]


def _gpt(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG).eval()


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_product_matches_linear_and_is_row_count_invariant(dtype):
    torch.manual_seed(0)
    lin = nn.Linear(96, 160).to(dtype)
    packed = PackedLinears(nn.Sequential(lin), dtype)
    x = torch.randn(37, 96, dtype=dtype)
    with torch.inference_mode(), packed.active():
        full = lin(x)
        rows = [lin(x[i : i + 1]) for i in range(0, 37, 5)]
    torch.testing.assert_close(full, torch.nn.functional.linear(x, lin.weight, lin.bias))
    for i, r in zip(range(0, 37, 5), rows):
        assert torch.equal(r[0], full[i])  # bitwise: a row's result does not depend on its pass
    assert "forward" not in lin.__dict__  # the module's own forward is back after the pass


def test_engine_uses_packed_weights_and_keeps_greedy_tokens(monkeypatch):
    plain_model = _gpt(0)
    monkeypatch.setenv("ZEAL_CPU_PACKED_LINEAR", "0")
    plain = LLM(plain_model, block_size=8, kv_cache_bytes=8 << 20)
    assert plain.engine.runner.packed is None
    expected = _tokens(plain)
    monkeypatch.delenv("ZEAL_CPU_PACKED_LINEAR")
    llm = LLM(_gpt(0), block_size=8, kv_cache_bytes=8 << 20)
    runner = llm.engine.runner
    assert runner.packed is not None  # every linear (the tied head included) packed at start-up
    assert runner.packed.nbytes == sum(m.weight.numel() * 4 for m in runner.packed.linears)
    assert _tokens(llm) == expected
    llm.sleep(level=2)
    assert runner.packed.nbytes == 0  # the packed copies go with the weights


def test_load_weights_and_in_place_updates_are_repacked():
    llm = LLM(_gpt(0), block_size=8, kv_cache_bytes=8 << 20)
    _tokens(llm)  # packs the seed-0 weights
    other = _gpt(1)
    llm.load_weights(other.named_parameters())
    fresh = LLM(_gpt(1), block_size=8, kv_cache_bytes=8 << 20)
    assert _tokens(llm) == _tokens(fresh)


def test_served_module_still_trains_through_f_linear():
    model = _gpt(0)
    llm = LLM(model, block_size=8, kv_cache_bytes=8 << 20)
    _tokens(llm)
    reference = _gpt(0)
    ids = torch.randint(0, CFG.vocab_size, (2, 16))
    model.train(), reference.train()
    model(ids, labels=ids).backward()
    reference(ids, labels=ids).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None and torch.equal(p.grad, q.grad), name


def test_linear_subclasses_with_their_own_forward_are_left_alone():
    class Scaled(nn.Linear):  # e.g. fake quantization: a forward of its own
        def forward(self, x):
            return 2 * super().forward(x)

    torch.manual_seed(0)
    model = nn.Sequential(Scaled(8, 8), nn.Linear(8, 8))
    packed = PackedLinears(model)
    assert packed.linears == [model[1]]
    x = torch.randn(3, 8)
    with torch.inference_mode():
        want = model(x)
        with packed.active():
            torch.testing.assert_close(model(x), want)
