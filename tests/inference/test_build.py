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
