"""zeal.utils.meta.meta_device: modules built on the meta device as under torch.device("meta"),
without their initialisers' random fills, so that building a model skeleton (every load of a
Hugging Face folder, every rank of `zeal train`) and starting a server do not import the
compiler (torch._dynamo: 2-3 s of each process's start on this machine)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from zeal.utils.meta import meta_device


def _llama():
    from zeal.models.llama import Llama, LlamaConfig

    return Llama(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, rope_scaling={"rope_type": "llama3",
                             "factor": 8.0, "original_max_position_embeddings": 32}))


def _gpt():
    from zeal.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))


@pytest.mark.parametrize("build", [_llama, _gpt, lambda: torch.nn.Embedding(10, 4)])
def test_same_module_as_torch_meta(build):
    with torch.device("meta"):
        want = build()
    with meta_device():
        got = build()
    assert [(n, p.shape, p.dtype, p.is_meta) for n, p in got.named_parameters()] == \
        [(n, p.shape, p.dtype, p.is_meta) for n, p in want.named_parameters()]
    assert all(p.is_meta for p in got.parameters())


def test_fills_of_real_tensors_still_run():
    g = torch.Generator().manual_seed(0)
    with meta_device():
        t = torch.zeros(4, device="cpu")
        torch.nn.init.normal_(t, generator=g)
        m = torch.empty(4)
        assert torch.nn.init.normal_(m) is m and m.is_meta
    assert t.abs().sum() > 0 and torch.equal(t, torch.randn(4, generator=torch.Generator().manual_seed(0)))


def test_rope_table_is_the_real_one_when_built_on_meta():
    from zeal.models.llama_config import rope_inv_freq

    with meta_device():
        model = _llama()
    assert not model.inv_freq.is_meta and torch.equal(model.inv_freq, rope_inv_freq(model.config))


@pytest.mark.timeout(60)
def test_skeletons_and_the_serving_import_leave_the_compiler_unimported():
    code = (
        "import sys, torch\n"
        "import zeal.inference, zeal.train.build, zeal.deepspeed\n"
        "from zeal.utils.meta import meta_device\n"
        "from zeal.models.llama import Llama, LlamaConfig\n"
        "from zeal.models.gpt import GPT, GPTConfig\n"
        "with meta_device():\n"
        "    Llama(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,"
        " num_attention_heads=4, num_key_value_heads=2))\n"
        "    GPT(GPTConfig(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "False", "building on meta_device or importing zeal.inference imported torch._dynamo"
