"""torch.compile of the decode step (zeal.inference.compiled_decode): the level per device and
flag, the compiled greedy tokens equal the eager ones on CPU (inductor, one compiled shape per
batch-size bucket, the fused attention kernel outside the graph), and a step whose compile
fails decodes eagerly instead of failing its requests."""

from __future__ import annotations

import pytest
import torch

from zeal.config.inference import EngineConfig
from zeal.inference import LLM, SamplingParams
from zeal.inference.compiled_decode import CompiledStep, OpaqueAttention, compile_level, outside_graph

PROMPTS = [[3, 9, 4, 12, 33, 8], [40, 41], [5, 6, 7, 8, 9, 10, 11], [2]]


def test_compile_level(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert compile_level(EngineConfig(), cpu) == 0  # CPU: the eager fused kernels (measured faster)
    assert compile_level(EngineConfig(compilation_config=3), cpu) == 3
    assert compile_level(EngineConfig(compilation_config=3, enforce_eager=True), cpu) == 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert compile_level(EngineConfig(), cuda) == 3 and compile_level(EngineConfig(enforce_eager=True), cuda) == 0
    assert compile_level(EngineConfig(compilation_config=0), cuda) == 0
    with pytest.raises(ValueError):
        EngineConfig(compilation_config=4)


def test_a_failed_compile_decodes_eagerly(monkeypatch):
    def broken(fn, dynamic=None):
        def run(inp):
            raise RuntimeError("no backend here")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    step = CompiledStep(lambda inp: inp["x"] * 2, 3)
    assert torch.equal(step({"x": torch.ones(2)}), torch.full((2,), 2.0))
    assert step.failed == "RuntimeError: no backend here"
    assert torch.equal(step({"x": torch.ones(1)}), torch.full((1,), 2.0))


def test_opaque_attention_keeps_the_layers_on_torch_ops():
    calls = []
    att = OpaqueAttention(lambda i, q, k, v, p: calls.append(i) or q)
    q = torch.ones(2, 4, 8)
    assert att.ops is None and att(1, q, q, q) is q and calls == [1]
    outside = outside_graph()  # the class a compiled step uses: its call is a graph break
    assert outside is outside_graph() and issubclass(outside, OpaqueAttention)
    assert outside(att.inner)(2, q, q, q) is q and calls == [1, 2]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_decode_gives_the_eager_greedy_tokens(llama_dir, backend, monkeypatch):
    """The default tier traces with ``aot_eager`` (dynamo and AOTAutograd: the graph pieces,
    breaks and recompiles inductor gets, without its C++ build, which a new environment pays
    again: 16 s against 4 s); the long tier compiles with inductor, the engine's backend."""
    if backend != "inductor":
        compile_ = torch.compile
        monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend=backend, **kw))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(llama_dir, block_size=4, num_blocks=96).generate(PROMPTS, params)]
    llm = LLM(llama_dir, block_size=4, num_blocks=96, max_num_seqs=4, compilation_config=3)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.graph_factory is None  # CPU: compiled, no graphs
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == ref
    assert graphs.forward.failed is None and graphs.stats.get("compiled", 0) >= 4, graphs.stats
    assert llm.engine.runner.k_cache[0].shape[0] == 96 + 1  # the padding rows' scratch block
