"""Exported folders load everywhere: ``zeal checkpoint export`` of a ``zeal train`` run
writes the run's tokenizer with the right special-token ids, so ``AutoTokenizer`` +
``AutoModelForCausalLM.generate`` give the greedy tokens of zeal's serving engine on
the same folder; ``--tokenizer PATH`` for a checkpoint away from its run; the chat
template of a fine-tuned Hugging Face folder goes with it."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["def ", "import os\n", "class Foo(object):\n    "]


def zeal(env: dict, *args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "zeal.cli.main", *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r.stdout


def export(*args: str) -> str:
    """``zeal checkpoint export ARGS`` through the command line's entry point, in this process
    (the command only reads and writes files); what it printed."""
    from zeal.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["checkpoint", "export", *args])
    assert rc == 0, (out.getvalue() + err.getvalue())[-4000:]
    return out.getvalue()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("export-tok")
    env = dict(os.environ, PYTHONPATH=str(ROOT), ZEAL_CACHE=str(root / "cache"),
               PYTHONWARNINGS="ignore::FutureWarning")
    zeal(env, "train", "--nproc", "1", "--steps", "40", "--run-dir", str(root / "run"), "--precision", "fp32", "--model", "gpt",
         "--data.max_bytes", "200000", "--data.vocab_size", "512", "--data.seq_len", "64", "--model.n_layer", "2",
         "--model.n_embd", "64", "--job.eval_interval", "0", "--job.eval_batches", "1", "--job.sample_tokens", "0")
    return root / "run", env


def _hf_greedy(folder: Path, prompts: list[str], n: int) -> list[list[int]]:
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    out = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


def _zeal_greedy(folder: Path, prompts: list[str], n: int, **kwargs) -> list[list[int]]:
    from zeal.inference import LLM, SamplingParams

    llm = LLM(str(folder), **kwargs)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0))]


@pytest.mark.timeout(300)
def test_exported_run_generates_in_transformers_as_in_zeal(run, tmp_path):
    run_dir, _ = run
    out = tmp_path / "hf"
    printed = export(str(run_dir), str(out))
    assert "tokenizer from" in printed and "<|endoftext|>" in printed, printed
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        assert (out / name).is_file(), name
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert len(tok) == 512 and tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["vocab_size"]) == (0, 0, 512)
    from zeal.inference.tokenizer import Tokenizer

    ours = Tokenizer.from_folder(out)
    for p in PROMPTS:
        assert tok(p).input_ids == ours.encode(p)
    hf, zl = _hf_greedy(out, PROMPTS, 12), _zeal_greedy(out, PROMPTS, 12)
    assert hf == zl and sum(len(t) for t in hf) > len(PROMPTS) * 4, (hf, zl)


@pytest.mark.timeout(300)
def test_checkpoint_away_from_its_run_takes_tokenizer_flag(run, tmp_path):
    run_dir, _ = run
    ckpts = tmp_path / "ckpts"
    shutil.copytree(run_dir / "checkpoints", ckpts)
    bare = tmp_path / "bare"
    assert "no tokenizer found" in export(str(ckpts), str(bare))
    config = json.loads((bare / "config.json").read_text())
    assert config["eos_token_id"] is None and not (bare / "tokenizer.json").exists()  # never GPT-2's 50256
    out = tmp_path / "hf"
    export(str(ckpts), str(out), "--tokenizer", str(run_dir / "tokenizer.json"))
    assert transformers.AutoTokenizer.from_pretrained(out).eos_token_id == 0
    # LLM(path, tokenizer=...) uses the tokenizer given for the weights-only folder
    assert _zeal_greedy(bare, PROMPTS[:1], 6, tokenizer=run_dir / "tokenizer.json") == _hf_greedy(out, PROMPTS[:1], 6)


TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.timeout(300)
def test_fine_tuned_folder_keeps_chat_template_and_special_tokens(tmp_path):
    from tokenizers import AddedToken

    import zeal
    from zeal.data.corpus import stdlib_corpus
    from zeal.data.tokenizer import train_tokenizer
    from zeal.inference.tokenizer import Tokenizer

    folder, run_dir = tmp_path / "base", tmp_path / "run"
    tok = train_tokenizer(stdlib_corpus(60_000).documents, 300)
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    vocab = tok.get_vocab_size()
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=vocab, n_positions=64, bos_token_id=1, eos_token_id=2,
    )).save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>", "chat_template": TEMPLATE}))
    # what a `zeal train --model base` run leaves: its config.json, tokenizer.json and checkpoints
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"job": {"hf_model": str(folder)}}))
    shutil.copy(folder / "tokenizer.json", run_dir / "tokenizer.json")
    engine = zeal.initialize(transformers.GPT2LMHeadModel.from_pretrained(folder), {
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2}})
    engine.save_checkpoint(str(run_dir / "checkpoints"), tag="step0")
    from zeal.checkpoint.export import export_hf

    s = export_hf(run_dir, tmp_path / "hf")
    im_start, im_end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    assert s["chat_template"] and (s["bos_token_id"], s["eos_token_id"]) == (im_start, im_end)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    messages = [{"role": "user", "content": "def f(x):"}]
    text = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == Tokenizer.from_folder(tmp_path / "hf").render_chat(messages)
    assert hf_tok.eos_token_id == im_end and hf_tok.pad_token_id == im_end
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (im_start, im_end)
