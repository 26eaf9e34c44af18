"""Export to a Hugging Face folder (zeal GPT and an HF GPT-2 trained under zeal, saved
by 2 ranks) loads in ``transformers`` with the logits of the trained model; inspect
and the ``zeal checkpoint`` command."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.dist_harness import run_ranks

transformers = pytest.importorskip("transformers")

GPT_CFG = {"vocab_size": 61, "n_positions": 16, "n_embd": 24, "n_layer": 2, "n_head": 3}


def _hf_model():
    cfg = transformers.GPT2Config(vocab_size=61, n_positions=16, n_embd=24, n_layer=2, n_head=3,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def _train_and_save(rank: int, world: int, root: str):
    import zeal
    from zeal.models.gpt import GPT, GPTConfig

    out = {}
    for name, stage, make in [("gpt", 3, lambda: GPT(GPTConfig(**GPT_CFG))), ("hf", 2, _hf_model)]:
        torch.manual_seed(0)
        engine = zeal.initialize(make(), {
            "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            x = torch.randint(0, 61, (2, 12), generator=g)
            loss = engine((x, x)) if name == "gpt" else engine({"input_ids": x, "labels": x})
            engine.backward(loss)
            engine.step()
        engine.save_checkpoint(f"{root}/{name}", tag="final")
        out[name] = engine.module_state_dict()
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    return root, run_ranks(_train_and_save, 2, str(root), timeout=150)[0]


@pytest.mark.timeout(120)
def test_export_zeal_gpt_and_hf_model_load_in_transformers(trained, tmp_path):
    from zeal.checkpoint.export import export_hf
    from zeal.models.gpt import GPT, GPTConfig

    root, states = trained
    x = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(9))
    # zeal GPT -> HF GPT-2
    ref = GPT(GPTConfig(**GPT_CFG))
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in states["gpt"].items()})
    summary = export_hf(root / "gpt", tmp_path / "gpt_hf")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt_hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ref.eval()(x), atol=2e-5, rtol=1e-5)
    assert summary["files"] == ["model.safetensors"]
    # HF model trained under zeal, sharded output, bf16
    ref = _hf_model().eval()
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in states["hf"].items()}, strict=False)
    summary = export_hf(root / "hf", tmp_path / "hf_out", max_shard_bytes=20_000)
    assert len(summary["files"]) > 1
    assert (tmp_path / "hf_out" / "model.safetensors.index.json").is_file()
    got = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf_out").eval()
    with torch.no_grad():
        torch.testing.assert_close(got(x).logits, ref(x).logits, atol=2e-5, rtol=1e-5)
        export_hf(root / "hf", tmp_path / "hf_bf16", dtype="bf16")
        half = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf_bf16", dtype=torch.float32).eval()
        assert (half(x).logits - ref(x).logits).abs().max() < 0.1


@pytest.mark.timeout(60)
def test_inspect_and_cli(trained, tmp_path, capsys):
    from zeal.checkpoint.export import inspect_checkpoint
    from zeal.cli.main import main

    root, _ = trained
    info = inspect_checkpoint(root / "gpt")
    assert info["verified"] and info["world_size"] == 2 and info["zero_stage"] == 3
    assert info["global_steps"] == 3 and info["parameters"] > 0
    assert main(["checkpoint", "inspect", str(root / "gpt")]) == 0
    out = capsys.readouterr().out
    assert "ZeRO stage 3" in out and "checksums verified" in out and "transformer.wte.weight" in out
    assert main(["checkpoint", "export", str(root / "hf"), str(tmp_path / "cli"), "--dtype", "fp16"]) == 0
    assert json.loads((tmp_path / "cli" / "config.json").read_text())["model_type"] == "gpt2"
    # a damaged file: inspect reports it and fails
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(root / "gpt", bad)
    f = bad / "final" / "rank00001.safetensors"
    f.write_bytes(f.read_bytes()[:-3] + b"xyz")
    assert main(["checkpoint", "inspect", str(bad)]) == 1
    assert "SHA-256 mismatch" in capsys.readouterr().out
    assert np.isfinite(info["parameters"])
