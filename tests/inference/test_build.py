"""``build_engine(InferenceConfig)``: the engine ``zeal serve`` runs, built in the serving
stack itself; the same greedy tokens as ``LLM`` over the same folder."""

from __future__ import annotations

import pytest
import torch

from zeal.config.inference import InferenceConfig
from zeal.inference import LLM, SamplingParams
from zeal.inference.build import build_engine
from zeal.inference.tokenizer import Tokenizer

PROMPT = [5, 9, 17, 3]


def _greedy(engine, n: int = 6) -> list[int]:
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                return list(out.outputs[0].token_ids)
    raise AssertionError("the request never finished")


@pytest.mark.timeout(60)
def test_build_engine_matches_llm(llama_dir):
    cfg = InferenceConfig.model_validate({"model": str(llama_dir), "dtype": "fp32",
                                          "engine": {"block_size": 4, "num_blocks": 32}})
    engine = build_engine(cfg)
    assert engine.tokenizer is not None
    llm = LLM(llama_dir, block_size=4, num_blocks=32)
    assert _greedy(engine) == _greedy(llm.engine)
    # one root: LLM's keyword arguments are the config zeal serve builds from the same flags
    assert llm.config == _serve_config(str(llama_dir), "--dtype", "float32", "--block-size", "4", "--num-blocks", "32")


def _serve_config(*argv: str) -> InferenceConfig:
    import argparse

    from zeal.cli.serve import add_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    return config_from_args(p.parse_args(list(argv)))


@pytest.mark.parametrize("kwargs,flags,match", [
    ({"quantized_matmul": "int8", "tensor_parallel_size": 2}, ["--quantized-matmul", "int8",
     "--tensor-parallel-size", "2"], "quantized_matmul 'int8' serves a resident, unsplit model"),
    ({"weights_offload": "disk", "max_resident_weights_gb": 1.0, "tensor_parallel_size": 2},
     ["--weights-offload", "disk", "--max-resident-weights-gb", "1", "--tensor-parallel-size", "2"],
     "weights_offload 'disk' is not supported with tensor_parallel_size 2"),
    ({"weights_offload_quant": "int4"}, ["--weights-offload-quant", "int4"],
     "weights_offload_quant 'int4' needs weights_offload 'disk' or 'cpu'"),
    ({"weights_offload": "disk"}, ["--weights-offload", "disk"], "weights_offload 'disk' needs max_resident_weights_gb"),
])
def test_llm_and_serve_refuse_alike(tmp_path, kwargs, flags, match):
    """The refusals are the config's validators: LLM(...) and zeal serve's flags give the same
    line, before any model is loaded (the folder does not even exist)."""
    missing = str(tmp_path / "no-model")
    with pytest.raises(ValueError, match=match) as from_llm:
        LLM(missing, **kwargs)
    with pytest.raises(ValueError, match=match) as from_flags:
        _serve_config(missing, *flags)
    assert str(from_llm.value) == str(from_flags.value)


@pytest.mark.timeout(60)
def test_build_engine_serves_an_instance(llama_dir):
    from zeal.models.hf import load_hf_model

    model, _ = load_hf_model(llama_dir, torch.float32)
    tok = Tokenizer.from_folder(llama_dir)
    cfg = InferenceConfig.model_validate({"engine": {"block_size": 4, "num_blocks": 32}})
    engine = build_engine(cfg, model=model, tokenizer=tok)
    assert engine.tokenizer is tok and engine.runner.model is model
    ref = build_engine(cfg.model_copy(update={"model": str(llama_dir)}))
    assert _greedy(engine) == _greedy(ref)
    offload = cfg.model_copy(update={"weights_offload": "disk", "max_resident_weights_gb": 1.0})
    with pytest.raises(ValueError, match="need a model folder"):
        build_engine(offload, model=model)
