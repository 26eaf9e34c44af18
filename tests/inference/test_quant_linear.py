"""Int8 weight-only matmuls (quantized_matmul='auto'): the layer against F.linear on the
dequantized weight, and greedy serving of a compressed folder against its dequantized serving."""

import pytest
import torch
import torch.nn.functional as F

from zeal.compression.quant import dequantize, quantize
from zeal.inference.quant_linear import Int8Linear, int8_supported
from zeal.models.hf import save_hf_folder
from zeal.models.llama import Llama, LlamaConfig

CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.08)

needs_kernel = pytest.mark.skipif(not int8_supported(32, torch.float32, torch.device("cpu")),
                                  reason="torch has no _weight_int8pack_mm")


@needs_kernel
@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_matches_f_linear_on_the_dequantized_weight(dtype):
    torch.manual_seed(0)
    w, b = torch.randn(48, 64), torch.randn(48)
    q, scale = quantize(w, 8)  # per channel: scale [48, 1]
    lin = Int8Linear(q, scale, b, dtype)
    x = torch.randn(2, 5, 64).to(dtype)
    ref = F.linear(x.float(), dequantize(q, scale.to(dtype).float()), b.to(dtype).float())
    got = lin(x)
    assert got.dtype == dtype and got.shape == (2, 5, 48)
    # fp32: the scale is applied once after the int8 sum instead of to each weight, so the two
    # differ by fp32 reassociation: a few ulps of the sum of |x·w| (64 terms, bound 64·2^-23).
    # bf16: the kernel rounds its output to bf16 once (2^-8 relative), against an fp32 reference.
    mag = F.linear(x.float().abs(), dequantize(q, scale.to(dtype).float()).abs(), b.abs().to(dtype).float())
    rel = 64 * 2.0**-23 if dtype == torch.float32 else 2.0**-8
    assert bool(((got.float() - ref).abs() <= rel * mag + 1e-6).all())
    assert not torch.equal(q.float(), torch.zeros_like(q.float()))


@needs_kernel
@pytest.mark.timeout(60)
def test_compressed_folder_serves_the_same_greedy_tokens_with_int8_matmuls(tmp_path, monkeypatch):
    pytest.importorskip("compressed_tensors")
    from zeal.compression.export import export_compressed
    from zeal.compression.modules import linear_targets

    monkeypatch.setattr("zeal.inference.model_runner.cpu_kernels", lambda: None)
    from zeal.inference import LLM, SamplingParams
    from zeal.inference.quant_linear import Int8Linear as QL

    torch.manual_seed(0)
    model = Llama(CFG).eval()
    targets = linear_targets(model)
    folder = save_hf_folder(model, tmp_path / "m")
    export_compressed(folder, {n: (8, None) for n in targets}, ignore=["lm_head"])
    prompts = [[3, 5, 7, 9], [11, 2, 40, 41, 42, 1]]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    dense = LLM(str(folder), block_size=4, num_blocks=64)
    int8 = LLM(str(folder), block_size=4, num_blocks=64, quantized_matmul="int8")
    auto = LLM(str(folder), block_size=4, num_blocks=64, quantized_matmul="auto")  # fp32: left dequantized
    assert not any(isinstance(m, QL) for m in auto.engine.runner.model.modules())
    swapped = [n for n, m in int8.engine.runner.model.named_modules() if isinstance(m, QL)]
    assert sorted(swapped) == sorted(targets)
    want = [o.outputs[0].token_ids for o in dense.generate(prompts, greedy)]
    got = [o.outputs[0].token_ids for o in int8.generate(prompts, greedy)]
    assert got == want
    with pytest.raises(ValueError, match="serve-only"):
        int8.load_weights([])
    with pytest.raises(ValueError, match="quantized_matmul must be one of"):
        LLM(str(folder), quantized_matmul="int3")
