"""`zeal checkpoint export` of zeal's Llama: the folder loads in transformers with the trained weights."""

from __future__ import annotations

import pytest
import torch

import zeal
from zeal.checkpoint import export_hf
from zeal.models import Llama, LlamaConfig

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("tied", [True, False])
def test_trained_llama_checkpoint_exports_to_llama_for_causal_lm(tmp_path, tied):
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=tied)
    torch.manual_seed(0)
    engine = zeal.initialize(Llama(cfg), {"train_micro_batch_size_per_gpu": 2,
                                          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                                          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    x = torch.randint(0, 96, (2, 16))
    for _ in range(2):
        engine.backward(engine({"input_ids": x, "labels": x}))
        engine.step()
    trained = engine.module_state_dict()
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    engine.close()

    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    ref = Llama(cfg)
    ref.load_state_dict(trained, strict=False)
    ref.eval()
    with torch.no_grad():
        want, got = ref(x), hf(x).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
