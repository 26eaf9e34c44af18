"""``LLM(..., dtype=...)`` takes a torch dtype or its name as vLLM users write it."""

from __future__ import annotations

import pytest
import torch

from zeal.inference import LLM
from zeal.inference.llm import torch_dtype


def test_names_resolve_like_serve_flags(monkeypatch):
    assert torch_dtype("bfloat16") is torch.bfloat16 and torch_dtype("BF16") is torch.bfloat16
    assert torch_dtype("float32") is torch.float32 and torch_dtype(torch.float16) is torch.float16
    monkeypatch.setattr("zeal.config.inference.cpu_has_native_bf16", lambda: False)
    assert torch_dtype("auto", "cpu") is torch.float32
    with pytest.raises(ValueError, match="dtype 'int3' is not one of"):
        torch_dtype("int3")


@pytest.mark.timeout(60)
def test_llm_takes_a_dtype_name(llama_dir):
    llm = LLM(llama_dir, dtype="bf16", block_size=4, num_blocks=32)
    assert {p.dtype for p in llm.engine.runner.model.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="dtype"):
        LLM(llama_dir, dtype="half-ish")
