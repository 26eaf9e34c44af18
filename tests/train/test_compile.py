"""The config's ``compile`` section (regional torch.compile of each block): the blocks it
finds, its errors, and training under ZeRO 0-3 and activation checkpointing on 2 gloo ranks
equal to the same run uncompiled (fp32, 1e-5 relative) for zeal's GPT and a Hugging Face
Llama. The default tier traces with ``aot_eager`` (dynamo + AOTAutograd, the graphs inductor
would get, without its C++ build); the long tier compiles with inductor."""

from __future__ import annotations

import pytest
import torch

from tests.dist_harness import run_ranks
from zeal.config import ConfigError
from zeal.config.schema import CompileConfig
from zeal.train.compile import apply_compile, blocks

STEPS, MICRO, SEQ = 3, 2, 16


def _gpt():
    from zeal.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2))


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def test_blocks_found_and_errors():
    assert len(blocks(_gpt())) == 2 and len(blocks(_llama())) == 2
    assert apply_compile(_gpt(), CompileConfig()) == 0  # off by default
    assert apply_compile(_gpt(), CompileConfig(enabled=True, disable=True)) == 0
    with pytest.raises(ConfigError, match="no repeated blocks"):
        apply_compile(torch.nn.Linear(2, 2), CompileConfig(enabled=True))
    with pytest.raises(ConfigError, match="compile.backend"):
        apply_compile(_gpt(), CompileConfig(enabled=True, kwargs={"backend": "eager"}))


def _train(rank: int, world: int, kind: str, stage: int, ckpt: bool, backend: str | None) -> list[float]:
    import zeal

    model = _gpt() if kind == "gpt" else _llama()
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}}}
    if ckpt:
        cfg["activation_checkpointing"] = {}
    if backend:
        cfg["compile"] = {"enabled": True, "backend": backend}
    engine = zeal.initialize(model, cfg)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x = torch.randint(0, 64, (world, MICRO, SEQ), generator=gen)[rank]
        out = engine(input_ids=x, labels=x) if kind == "llama" else engine(x, x)
        loss = out.loss if kind == "llama" else out
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.close()
    if backend:  # compiled for real: graphs were traced (one per block class and stage, reused by the layers)
        from torch._dynamo.utils import counters

        losses.append(-float(counters["stats"]["unique_graphs"]))
        torch._dynamo.reset()
        counters.clear()
    return losses


def _compare(rank: int, world: int, kind: str, cases: list[tuple[int, bool]], backend: str) -> list:
    return [(_train(rank, world, kind, s, c, backend), _train(rank, world, kind, s, c, None)) for s, c in cases]


EVERY_STAGE = [(0, False), (1, False), (2, False), (3, False), (3, True), (2, True)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind, cases", [
    # the default tier: every stage once over the two families, checkpointing on and off in each;
    # each family's full matrix is in the long tier
    pytest.param("gpt", [(0, False), (2, True), (3, True)], id="gpt"),
    pytest.param("gpt", EVERY_STAGE, id="gpt-every-stage", marks=pytest.mark.slow),
    # HF Llama: the layers that checkpoint themselves (their inner forward compiled) under ZeRO 3,
    # and one stage without
    pytest.param("llama", [(1, False), (3, True)], id="llama"),
    pytest.param("llama", EVERY_STAGE, id="llama-every-stage", marks=pytest.mark.slow),
])
def test_compiled_blocks_train_as_eager_under_every_stage(kind, cases):
    for rank_out in run_ranks(_compare, 2, kind, cases, "aot_eager", timeout=280):
        for (s, c), (compiled, eager) in zip(cases, rank_out):
            *compiled, graphs = compiled
            print(kind, s, c, "graphs", -graphs)
            assert 1 <= -graphs <= 4, (kind, s, c, -graphs)
            assert compiled == pytest.approx(eager, rel=1e-5), (kind, s, c)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_inductor_compiled_blocks_train_as_eager():
    cases = [(0, False), (3, False), (3, True)]
    for rank_out in run_ranks(_compare, 2, "gpt", cases, "inductor", timeout=880):
        for (s, c), (compiled, eager) in zip(cases, rank_out):
            assert compiled[:-1] == pytest.approx(eager, rel=1e-5), (s, c)


def test_deepspeed_engine_compile_and_flops_profiler_accessors():
    """DeepSpeed's ``engine.compile(backend, compile_kwargs)`` and ``flops_profiler_*`` readers."""
    import zeal.deepspeed as deepspeed

    engine, *_ = deepspeed.initialize(model=_gpt(), config={
        "train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "flops_profiler": {"enabled": True, "profile_step": 3, "top_modules": 2}})
    assert not engine.is_compiled and engine.flops_profiler_profile_step() == 3
    assert engine.flops_profiler_top_modules() == 2 and engine.flops_profiler_enabled()
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    engine.compile(backend="eager")
    assert engine.is_compiled
    x = torch.randint(0, 64, (MICRO, SEQ))
    loss = engine(x, x)
    engine.backward(loss)
    engine.step()
    assert torch.isfinite(loss) and counters["stats"]["unique_graphs"] >= 1  # the blocks ran compiled
