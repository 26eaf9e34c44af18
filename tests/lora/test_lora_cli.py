"""``--lora K=V,...`` parsing, and ``zeal train --model HF --lora ...`` end to end: the
run folder gets a PEFT adapter that ``peft`` loads, and ``zeal checkpoint export
--merge-lora`` writes a folder whose logits equal base + adapter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zeal.cli.lora_flag import parse_lora_flag
from zeal.cli.overrides import UsageError

ROOT = Path(__file__).resolve().parents[2]


def test_parse_lora_flag():
    assert parse_lora_flag("") == {"enabled": True}
    assert parse_lora_flag("r=16,lora_alpha=32,target_modules=q_proj,v_proj,dropout=0.05,quant=int4") == {
        "enabled": True, "r": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"], "dropout": 0.05,
        "quantize_base": "int4"}
    assert parse_lora_flag("target_modules=all-linear,modules_to_save=lm_head")["target_modules"] == "all-linear"
    assert parse_lora_flag(r"target_modules=.*\.(q|v)_proj")["target_modules"] == r".*\.(q|v)_proj"
    with pytest.raises(UsageError, match="unknown key 'rr'"):
        parse_lora_flag("rr=3")
    with pytest.raises(UsageError, match="not key=value"):
        parse_lora_flag("r=3,oops")


def _zeal(env: dict, *args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "zeal.cli.main", *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=170)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r.stdout


def test_train_flag_sets_the_lora_section():
    import argparse

    from zeal.cli.train import add_parser, build_spec

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args, extra = parser.parse_known_args(["train", "--nproc", "1", "--lora", "r=4,target_modules=q_proj,v_proj"])
    lora = build_spec(args, extra).engine["lora"]
    assert lora["enabled"] and lora["r"] == 4 and lora["target_modules"] == ["q_proj", "v_proj"]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_train_lora_writes_peft_adapter_and_merged_export(tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from zeal.data.corpus import stdlib_corpus
    from zeal.data.tokenizer import train_tokenizer

    torch.manual_seed(0)
    folder = tmp_path / "hf"
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0))
    base.save_pretrained(folder)
    train_tokenizer(stdlib_corpus(50_000).documents, 300).save(str(folder / "tokenizer.json"))
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Q: {i} + {i}? ", "completion": f"A: {2 * i}\n"}) + "\n"
                            for i in range(100)))
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT), ZEAL_CACHE=str(tmp_path / "cache"),
               PYTHONWARNINGS="ignore::FutureWarning")
    out = _zeal(env, "train", "--model", str(folder), "--data", str(data), "--nproc", "1", "--steps", "3",
                "--run-dir", str(run), "--data.seq_len", "32", "--job.sample_tokens", "0", "--job.eval_interval",
                "0", "--precision", "fp32", "--lora", "r=4,alpha=8,target_modules=q_proj,v_proj,init=zeros_a")
    assert "LoRA adapter" in out
    cfg = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["target_modules"] == ["q_proj", "v_proj"]
    pm = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(folder), str(run / "adapter"))
    ids = torch.tensor([[5, 17, 42, 99, 3]])
    with torch.no_grad():
        want = pm(ids).logits
        assert (want - base(ids).logits).abs().max() > 1e-4  # the adapter trained
    _zeal(env, "checkpoint", "export", str(run), str(tmp_path / "merged"), "--merge-lora")
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, want, rtol=0, atol=1e-5)
