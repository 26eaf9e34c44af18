"""Decode-graph bookkeeping on CPU: buckets, padding into static buffers, one capture per
bucket then replays, eager for prefill/mixed/over-size/enforce_eager; and a whole serving
run through graphs (a fake graph that replays by re-running on the static buffers) gives
the eager run's tokens. GPU defaults: CPU sizes unchanged, CUDA sizes from free memory."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from zeal.config.inference import EngineConfig
from zeal.inference import LLM, SamplingParams
from zeal.inference.cuda_graphs import DecodeGraphs, FakeGraph, InputSpec, decode_buckets
from zeal.inference.gpu_defaults import CUDA_MAX_NUM_BATCHED_TOKENS, CUDA_MAX_NUM_SEQS, engine_sizes


def test_buckets():
    assert decode_buckets(1) == [1]
    assert decode_buckets(6) == [1, 2, 4, 6]
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert decode_buckets(20) == [1, 2, 4, 8, 16, 20]


def _graphs(**kw):
    seen = []

    def forward(inp):
        seen.append({k: v.clone() for k, v in inp.items()})
        return inp["x"].float() * 2 + inp["t"].sum(-1, keepdim=True).float()

    specs = {"x": InputSpec((1,), torch.int64, pad=-1), "t": InputSpec((3,), torch.int32, pad=7)}
    return DecodeGraphs(forward, specs, 20, torch.device("cpu"), FakeGraph, **kw), seen


def _inputs(n, base=0):
    return {"x": torch.arange(base, base + n)[:, None], "t": torch.ones(n, 3, dtype=torch.int32)}


def test_capture_once_per_bucket_then_replay_with_padding():
    g, seen = _graphs()
    out = g.run(_inputs(3))
    assert torch.equal(out, torch.tensor([[3.0], [5.0], [7.0]]))
    assert g.stats == {"eager": 0, "replay": 0, "capture": 1} and list(g.graphs) == [4]
    assert seen[-1]["x"].shape == (4, 1) and seen[-1]["x"][3].item() == -1 and seen[-1]["t"][3].tolist() == [7] * 3
    out = g.run(_inputs(4, base=10))  # same bucket: a replay over the refilled static buffers
    assert torch.equal(out[:, 0], torch.tensor([23.0, 25.0, 27.0, 29.0]))
    assert g.stats["replay"] == 1 and g.stats["capture"] == 1
    out = g.run(_inputs(2, base=1))  # the padding of a smaller batch overwrites the rows left from before
    assert torch.equal(out[:, 0], torch.tensor([5.0, 7.0])) and seen[-1]["x"][:, 0].tolist() == [1, 2]
    assert sorted(g.graphs) == [2, 4]
    g.run(_inputs(3, base=5))
    assert seen[-1]["x"][:, 0].tolist() == [5, 6, 7, -1]  # the replay read the padded static rows
    assert g.graphs[4].graph.replays == 2
    g.reset()  # sleep: the captured addresses go stale; the next step captures again
    g.run(_inputs(3))
    assert g.stats["capture"] == 3 and sorted(g.graphs) == [4]


def test_eager_cases():
    g, _ = _graphs()
    g.run(_inputs(21))  # beyond the largest bucket
    g.run(_inputs(3), decode_only=False)  # prefill / mixed step
    assert g.stats == {"eager": 2, "replay": 0, "capture": 0}
    g, _ = _graphs(enforce_eager=True)
    assert torch.equal(g.run(_inputs(3))[:, 0], torch.tensor([3.0, 5.0, 7.0])) and not g.graphs
    g, _ = _graphs()
    with pytest.raises(ValueError, match="'t'"):
        g.run({"x": torch.zeros(2, 1, dtype=torch.int64), "t": torch.zeros(2, 4, dtype=torch.int32)})


@pytest.mark.timeout(120)
def test_serving_through_decode_graphs_gives_the_eager_tokens(llama_dir, monkeypatch):
    prompts = [[3, 9, 4, 12, 33, 8], [40, 41], [5, 6, 7, 8, 9, 10, 11], [2]]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(llama_dir, block_size=4, num_blocks=96).generate(prompts, params)]
    monkeypatch.setenv("ZEAL_ATTENTION_BACKEND", "flex")
    llm = LLM(llama_dir, block_size=4, num_blocks=96)
    runner = llm.engine.runner
    runner.enable_decode_graphs(8, llm.engine.max_seq_tokens, graph_factory=FakeGraph)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == ref
    st = runner.graphs.stats
    assert st["capture"] >= 1 and st["replay"] >= 5, st
    # the scratch block (padding rows' slot) lies past the block manager's blocks
    assert runner.k_cache[0].shape[0] == 96 + 1 and runner.scratch_slot == 96 * 4


def _model():
    cfg = SimpleNamespace(hidden_size=64, intermediate_size=128, vocab_size=100)
    return SimpleNamespace(config=cfg, parameters=lambda: iter([torch.zeros(1, dtype=torch.bfloat16)]))


def test_engine_sizes_cpu_unchanged_cuda_from_free_memory(monkeypatch):
    cpu = torch.device("cpu")
    s = engine_sizes(EngineConfig(), _model(), cpu, 1 << 16)
    assert (s.num_blocks, s.max_num_batched_tokens, s.max_num_seqs) == ((512 << 20) >> 16, 512, 64)
    assert engine_sizes(EngineConfig(num_blocks=7), _model(), cpu, 1 << 16).num_blocks == 7
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (70 << 30, 80 << 30))  # 10 GiB in use
    cuda = torch.device("cuda")
    s = engine_sizes(EngineConfig(), _model(), cuda, 1 << 20)
    assert (s.max_num_batched_tokens, s.max_num_seqs) == (CUDA_MAX_NUM_BATCHED_TOKENS, CUDA_MAX_NUM_SEQS)
    assert 61 * 1024 < s.num_blocks < 62 * 1024  # 0.9 * 80 - 10 = 62 GiB less the activation reserve
    s = engine_sizes(EngineConfig(gpu_memory_utilization=0.5, max_num_seqs=8), _model(), cuda, 1 << 20)
    assert s.max_num_seqs == 8 and 29 * 1024 < s.num_blocks < 30 * 1024
    assert engine_sizes(EngineConfig(kv_cache_bytes=1 << 30), _model(), cuda, 1 << 20).num_blocks == 1024
    with pytest.raises(ValueError, match="gpu_memory_utilization 0.1"):
        engine_sizes(EngineConfig(gpu_memory_utilization=0.1), _model(), cuda, 1 << 20)
