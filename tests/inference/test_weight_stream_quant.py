"""ZeRO-Inference with int8 / int4 weight-only layer files: streamed greedy tokens and
logits equal (bitwise, fp32) those of the fully resident model whose decoder-layer
weight matrices went through the same quantizer (``zeal.compression.quant.quantize``
with bf16 scales, then ``dequantize``); the layer files hold exactly the packed codes and
scales; the resident bytes stay under the budget."""

from __future__ import annotations

import math

import pytest
import torch

from tests.inference.conftest import stop_app
from zeal.compression.quant import dequantize, quantize
from zeal.inference.llm import LLM
from zeal.inference.sampling_params import SamplingParams
from zeal.inference.weight_quant import code_bytes, group_size_for, unpack_codes
from zeal.inference.weight_stream import LayerFiles
from zeal.models.hf import load_hf_model

GB = 1 << 30
PROMPTS = [[5, 9, 13, 2, 40, 41], [7] * 3, list(range(10, 60))]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # hidden 80: rows of 80 take groups of 16; intermediate 192: groups of 64
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=96, hidden_size=80, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.08, tie_word_embeddings=False))
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path, max_shard_size="60KB")
    return path


def _reference(path, bits: int, dtype: torch.dtype = torch.float32):
    """The resident model with every 2-d decoder-layer weight quantize-dequantized."""
    model, _ = load_hf_model(path, dtype)
    for layer in model.layer_stack():
        for p in layer.parameters():
            if p.dim() == 2:
                q, s = quantize(p.data, bits, group_size_for(p.shape[1]), scale_dtype=torch.bfloat16)
                p.data = dequantize(q, s, p.dtype)
    return model.eval()


def _logits(model, x):
    out = model(x)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("quant,bits", [("int8", 8), ("int4", 4)])
def test_quantized_stream_equals_quantize_dequantized_resident(folder, tmp_path, quant, bits):
    params = SamplingParams(max_tokens=12, temperature=0.0)
    ref = _reference(folder, bits)
    want = [o.outputs[0].token_ids for o in LLM(ref, num_blocks=64, block_size=16).generate(PROMPTS, params)]
    assert want != [o.outputs[0].token_ids for o in LLM(str(folder), num_blocks=64).generate(PROMPTS, params)] \
        or bits == 8  # int4 changes this model's greedy tokens: the reference is not the plain model
    plain, _ = load_hf_model(folder)
    layer = plain.layer_stack()[0]
    dense_layer = sum(p.numel() * 4 for p in layer.parameters())
    budget = 0.6 * sum(p.numel() * 4 for p in plain.parameters()) / GB  # ~2 slots of 4 layers
    llm = LLM(folder, num_blocks=64, block_size=16, weights_offload="disk", max_resident_weights_gb=budget,
              offload_dir=str(tmp_path / "layers"), weights_offload_quant=quant)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == want
    model = llm.engine.runner.model
    st = model.weight_streamer.stats
    assert st.slots >= 2 and st.resident_bytes <= budget * GB
    x = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        assert torch.equal(_logits(model, x), _logits(ref, x))

    # The layer files: exactly the packed codes and bf16 scales (+ fp32 norms), 64-byte aligned.
    files = LayerFiles.open(tmp_path / "layers")
    assert files.quant == quant
    named = dict(layer.named_parameters())
    off = 0
    for key in sorted(named):
        p = named[key]
        pieces = [p.numel() * 4] if p.dim() == 1 else \
            [code_bytes(p.numel(), bits), p.shape[0] * (p.shape[1] // group_size_for(p.shape[1])) * 2]
        for n in pieces:
            off = -(-off // 64) * 64 + n
    for i, entry in enumerate(files.layers):
        assert entry["nbytes"] == off == (tmp_path / "layers" / entry["file"]).stat().st_size
        assert st.layer_bytes[i] == off
    assert off < dense_layer * (0.3 if bits == 8 else 0.17)  # vs fp32: ~1/4 and ~1/8
    read = sum(n for _, _, n in files.pieces(0))  # the tensors (codes through scales), not the padding
    if model.weight_streamer.pending is not None:  # the last forward's prefetch may still be reading:
        model.weight_streamer.pending[2].result()  # its bytes are counted piece by piece, its read at the end
    assert off - 64 * len(named) < read <= off and st.bytes_read == st.reads * read


@pytest.mark.timeout(120)
def test_bf16_int4_stream_equals_quantize_dequantized_resident(folder, tmp_path):
    """bf16 slots are dequantized in place (bf16 multiply of exact fp32 products): the same tokens."""
    params = SamplingParams(max_tokens=12, temperature=0.0)
    ref = _reference(folder, 4, torch.bfloat16)
    want = [o.outputs[0].token_ids for o in LLM(ref, num_blocks=64, block_size=16).generate(PROMPTS, params)]
    llm = LLM(folder, dtype=torch.bfloat16, num_blocks=64, block_size=16, weights_offload="disk",
              max_resident_weights_gb=1.0, offload_dir=str(tmp_path / "layers"), weights_offload_quant="int4")
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == want


def test_int4_codes_round_trip():
    from zeal.inference.weight_quant import encode

    torch.manual_seed(1)
    w = torch.randn(6, 48)
    codes, scales, group = encode(w, 4)
    assert group == 16 and len(codes) == 6 * 48 // 2 and len(scales) == 6 * 3 * 2
    q, s = quantize(w, 4, 16, scale_dtype=torch.bfloat16)
    packed = torch.frombuffer(bytearray(codes), dtype=torch.uint8)
    assert torch.equal(unpack_codes(packed, 4, w.numel()).view(6, 48), q)
    assert torch.equal(torch.frombuffer(bytearray(scales), dtype=torch.bfloat16).view(6, 3), s)
    assert q.min() >= -8 and q.max() <= 7 and math.isclose(float(q.abs().max()), 7)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_into_equals_quantize_dequantize(bits, dtype):
    from zeal.inference.weight_quant import decode_into, encode, quantize_dequantize_weight

    torch.manual_seed(2)
    w = (torch.randn(24, 80) * torch.logspace(-6, 1, 24)[:, None]).to(dtype)  # scales over 7 decades
    codes, scales, _ = encode(w, bits)
    out = torch.empty_like(w)
    decode_into(out, torch.frombuffer(bytearray(codes), dtype=torch.uint8),
                torch.frombuffer(bytearray(scales), dtype=torch.uint8), bits, torch.empty(7 * 80))  # 7 rows a time
    assert torch.equal(out, quantize_dequantize_weight(w, bits))
    assert not torch.equal(out, w)


def test_bad_quant_values_are_refused(folder, tmp_path):
    with pytest.raises(ValueError, match="weights_offload_quant must be one of none, int8, int4, got 'int3'"):
        LLM(folder, weights_offload="disk", max_resident_weights_gb=1.0, weights_offload_quant="int3")
    with pytest.raises(ValueError, match="weights_offload_quant 'int8' needs weights_offload 'disk' or 'cpu'"):
        LLM(folder, weights_offload_quant="int8")
    LLM(folder, weights_offload="disk", max_resident_weights_gb=1.0, offload_dir=str(tmp_path / "l"),
        weights_offload_quant="int8")
    with pytest.raises(ValueError, match="holds int8 layer files"):  # the same folder, another storage
        LLM(folder, weights_offload="disk", max_resident_weights_gb=1.0, offload_dir=str(tmp_path / "l"),
            weights_offload_quant="int4")


def test_serve_flag(folder, tmp_path):
    import argparse

    from zeal.cli import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    argv = [str(folder), "--dtype", "float32", "--weights-offload", "disk", "--offload-dir", str(tmp_path / "l"),
            "--max-resident-weights-gb", "1", "--weights-offload-quant", "int4"]
    cfg = serve.config_from_args(parser.parse_args(argv))
    assert cfg.weights_offload_quant == "int4"
    stop_app(serve.build(cfg)[0])
    with pytest.raises(SystemExit):  # argparse: invalid choice
        parser.parse_args([*argv[:-1], "int2"])
    with pytest.raises(ValueError, match="needs weights_offload 'disk' or 'cpu'"):  # refused by the config
        serve.config_from_args(parser.parse_args([str(folder), "--weights-offload-quant", "int8"]))
