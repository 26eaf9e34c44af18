"""`zeal compress` end to end on a tiny Llama folder with a character tokenizer."""

import json

import pytest
import torch

from tests.inference.conftest import VOCAB, _save_tokenizer
from tests.needs import needs
from zeal.cli.main import main
from zeal.compression.export import decompress_state
from zeal.compression.nm import group_density
from zeal.models.hf import load_hf_model, save_hf_folder
from zeal.models.llama import Llama, LlamaConfig

pytestmark = needs("compressed_tensors")


@pytest.mark.timeout(120)
def test_compress_admm_w4_writes_a_folder_that_reloads_sparse_and_quantized(tmp_path, capsys):
    torch.manual_seed(0)
    src = save_hf_folder(Llama(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                           initializer_range=0.08)), tmp_path / "src")
    _save_tokenizer(src)
    data = tmp_path / "text.txt"
    data.write_text("\n\n".join(f"paragraph {i}: the quick brown fox jumps over the lazy dog." * 3 for i in range(20)))
    out = tmp_path / "out"
    rc = main(["compress", "--model", str(src), "--sparsity", "2:4", "--method", "admm", "--steps", "4", "--bits", "4",
               "--group-size", "16", "--data", str(data), "--seq-len", "32", "--calib-blocks", "4",
               "--eval-blocks", "2", "--lr", "1e-3", "--out", str(out)])
    assert rc == 0
    log = capsys.readouterr().out
    report = json.loads(log.strip().splitlines()[-1])
    assert report["ppl_before"] > 1 and report["ppl_after"] > 1
    model, cfg = load_hf_model(out, state_transform=decompress_state)
    assert cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] == 4
    w = model.model.layers[0].mlp.down_proj.weight
    assert bool((group_density(w != 0, 4) <= 2).all())
    assert len(torch.unique(w[0, :16])) <= 16  # at most 16 int4 levels per group
    assert (out / "tokenizer.json").is_file()
    written = json.loads((out / "config.json").read_text())
    assert "top_k" not in written and "num_experts" not in written  # a dense model's keys only
    assert "admm block 1/1 (model.layers.0, 7 linears)" in log and "left" in log  # progress per block


def test_compress_flags_are_checked():
    assert main(["compress", "--out", "x"]) == 2
    assert main(["compress", "--sparsity", "5:4", "--out", "x"]) == 2
    assert main(["compress", "--sparsity", "2:4", "--method", "admm", "--admm-iters", "0", "--out", "x"]) == 2
    with pytest.raises(SystemExit):  # argparse: not one of reconstruction, loss
        main(["compress", "--sparsity", "2:4", "--method", "admm", "--admm-objective", "nope", "--out", "x"])


def test_a_perplexity_blowup_ends_in_one_warning_naming_a_better_method():
    from zeal.cli.compress import blowup_warning
    from zeal.compression.pipeline import CompressJob

    assert blowup_warning(CompressJob(2, 4, "magnitude"), 16.4, 40.0) is None  # 2.4x: no warning
    w = blowup_warning(CompressJob(2, 4, "magnitude"), 16.387, 1671.0)  # what the README's magnitude run did
    assert w.startswith("warning: perplexity went from 16.39 to 1671.00") and "--method wanda" in w
    assert "\n" not in w
    assert "--steps" in blowup_warning(CompressJob(2, 4, "wanda"), 16.0, 60.0)
    assert "--group-size" in blowup_warning(CompressJob(None, 4, "magnitude", bits=4), 16.0, 60.0)
    assert blowup_warning(CompressJob(2, 4, "admm"), 16.0, float("nan")) is not None
