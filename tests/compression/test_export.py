"""compressed-tensors export: reload gives exactly the fake-quantized (and 2:4-sparse)
weights; zeal's server greedy-decodes the folder as the fake-quantized model does."""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.needs import needs
from zeal.compression.export import decompress_state
from zeal.compression.modules import QuantSpec, apply_masks_, linear_targets, magnitude_masks, swap_qat
from zeal.compression.quant import quantize_dequantize
from zeal.models.hf import load_hf_model, save_hf_folder
from zeal.models.llama import Llama, LlamaConfig

pytestmark = needs("compressed_tensors")

CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.08)


@pytest.mark.timeout(120)
def test_export_reloads_fake_quantized_weights_and_serves_the_same_greedy_tokens(tmp_path, monkeypatch):
    from zeal.compression.export import export_compressed

    # the pure-torch serving path (building the fused CPU kernels is another test's cost)
    monkeypatch.setattr("zeal.inference.model_runner.cpu_kernels", lambda: None)
    from zeal.inference import LLM, SamplingParams

    torch.manual_seed(0)
    model = Llama(CFG).eval()
    targets = linear_targets(model)
    apply_masks_(model, magnitude_masks(targets, 2, 4))
    quant = {n: ((4, 16) if "mlp" in n else (8, None)) for n in targets}
    folder = save_hf_folder(model, tmp_path / "m")
    export_compressed(folder, quant, sparse={n: (2, 4) for n in targets}, ignore=["lm_head"])

    stored = load_file(str(folder / "model.safetensors"))
    layer = "model.layers.0.mlp.down_proj"
    assert stored[f"{layer}.weight_packed"].dtype == torch.int32 and f"{layer}.weight" not in stored
    assert stored[f"{layer}.weight_packed"].shape == (32, 64 * 4 // 32)  # 8 int4 codes per int32
    assert stored[f"{layer}.weight_scale"].shape == (32, 4)
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["sparsity_config"]["sparsity_structure"] == "2:4" and qc["sparsity_config"]["global_sparsity"] == 0.5
    # vLLM 0.32 refuses a sparsity config that lists targets (compressed-tensors dropped sparse compression)
    assert not qc["sparsity_config"].get("targets") and qc["sparsity_config"]["ignore"] == ["lm_head"]

    with pytest.raises(ValueError, match="compressed-tensors weights"):  # model code reads no stored format
        load_hf_model(folder)
    loaded, _ = load_hf_model(folder, state_transform=decompress_state)
    for name, lin in targets.items():
        want = quantize_dequantize(lin.weight.detach(), *quant[name])
        got = loaded.get_submodule(name).weight
        assert torch.equal(got, want), name
        assert bool((got[lin.weight == 0] == 0).all())  # sparse zeros stay zero

    for spec in ((4, 16), (8, None)):
        swap_qat(model, [n for n, q in quant.items() if q == spec], QuantSpec(*spec))
    prompts = [[3, 5, 7, 9], [11, 2, 40, 41, 42, 1]]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    fake = [o.outputs[0].token_ids for o in LLM(model, block_size=4, num_blocks=64).generate(prompts, greedy)]
    served = [o.outputs[0].token_ids for o in LLM(str(folder), block_size=4, num_blocks=64).generate(prompts, greedy)]
    assert served == fake


@pytest.mark.timeout(120)
def test_hugging_face_reads_the_export_with_the_same_weights(tmp_path):
    """transformers decompresses the folder through compressed-tensors' own code: the same weights."""
    from transformers import AutoModelForCausalLM

    from zeal.compression.export import export_compressed

    torch.manual_seed(0)
    model = Llama(CFG).eval()
    targets = linear_targets(model)
    folder = save_hf_folder(model, tmp_path / "m")
    export_compressed(folder, {n: (4, 32) for n in targets}, ignore=["lm_head"])
    ours, _ = load_hf_model(folder, state_transform=decompress_state)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    x = torch.tensor([[1, 5, 9, 20, 33]])
    with torch.no_grad():  # (the first forward decompresses HF's modules)
        assert torch.allclose(ours(x), hf(x).logits, atol=1e-5)
    for name, lin in targets.items():
        want = quantize_dequantize(lin.weight.detach(), 4, 32)
        assert torch.equal(hf.get_submodule(name).weight.detach(), want), name
        assert torch.equal(ours.get_submodule(name).weight, want), name


@pytest.mark.timeout(60)
def test_sparse_export_records_no_target_list_and_sparse_only_is_a_plain_folder(tmp_path):
    """vLLM 0.32 refuses any sparsity config naming targets, and transformers 5.17 with
    compressed-tensors 0.19 fails on a compressed-tensors config without quantization
    groups: a quantized layer left dense is listed in the sparsity ``ignore``; a
    sparse-only export is the plain dense folder (no ``quantization_config``)."""
    from zeal.compression.export import export_compressed

    torch.manual_seed(0)
    model = Llama(CFG).eval()
    targets = linear_targets(model)
    apply_masks_(model, magnitude_masks(targets, 2, 4))
    want = {n: lin.weight.detach().clone() for n, lin in targets.items()}
    sparse = {n: (2, 4) for n in targets if "mlp" in n}
    folder = save_hf_folder(model, tmp_path / "q")
    export_compressed(folder, {n: (8, None) for n in targets}, sparse, ignore=["lm_head"])
    sc = json.loads((folder / "config.json").read_text())["quantization_config"]["sparsity_config"]
    assert "targets" not in sc
    assert sc["ignore"] == sorted(["lm_head", *(n for n in targets if n not in sparse)])

    folder = save_hf_folder(model, tmp_path / "s")
    before = (folder / "model.safetensors").read_bytes()
    export_compressed(folder, {}, {n: (2, 4) for n in targets}, ignore=["lm_head"])
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    assert (folder / "model.safetensors").read_bytes() == before
    loaded, _ = load_hf_model(folder, state_transform=decompress_state)
    for name, w in want.items():
        assert torch.equal(loaded.get_submodule(name).weight, w), name
