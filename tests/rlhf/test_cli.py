"""`zeal rlhf` on a tiny Llama folder with a word-level tokenizer built here (no download):
each job writes the metrics the issue names, checkpoints and the exported model; the
steps chain (RM → PPO with the reward model); bad input is one line and status 2."""

import csv
import json

import pytest

from tests.rlhf.conftest import build_tiny_folder
from zeal.cli.main import main

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    d = build_tiny_folder(tmp_path_factory.mktemp("tiny"))
    cfg = d / "ds.json"
    cfg.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                               "rlhf": {"batch_size": 2, "num_generations": 2, "max_new_tokens": 4}}))
    return d


def _columns(out):
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    return rows, rows[-1]


@pytest.mark.parametrize("job", ["grpo", "dpo", "sft"])
def test_jobs_write_metrics_checkpoints_and_model(tiny_folder, tmp_path, job, capsys):
    out = tmp_path / job
    rc = main(["rlhf", job, "--model", str(tiny_folder), "--steps", "2", "--out", str(out),
               "--config", str(tiny_folder / "ds.json")])
    assert rc == 0, capsys.readouterr().err
    rows, last = _columns(out)
    assert [r["step"] for r in rows] == ["1", "2"]
    for col in ("loss", "time_train_s", "time_generate_s", "time_sync_s"):
        assert last[col] != ""
    if job in ("grpo", "dpo"):
        assert all(last[c] != "" for c in ("reward", "kl", "response_length"))
    assert (out / "checkpoints" / "latest").exists()
    assert (out / "model" / "config.json").exists() and (out / "model" / "tokenizer.json").exists()


def test_rm_then_ppo_with_the_reward_model(tiny_folder, tmp_path, capsys):
    rm = tmp_path / "rm"
    assert main(["rlhf", "rm", "--model", str(tiny_folder), "--steps", "2", "--out", str(rm),
                 "--config", str(tiny_folder / "ds.json")]) == 0, capsys.readouterr().err
    _, last = _columns(rm)
    assert last["accuracy"] != ""
    ppo = tmp_path / "ppo"
    assert main(["rlhf", "ppo", "--model", str(tiny_folder), "--reward-model", str(rm), "--steps", "2",
                 "--out", str(ppo), "--config", str(tiny_folder / "ds.json")]) == 0, capsys.readouterr().err
    _, last = _columns(ppo)
    assert all(last[c] != "" for c in ("reward", "kl", "response_length", "loss", "value_loss"))


def test_bad_input_is_one_line(tiny_folder, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    assert main(["rlhf", "dpo", "--model", str(tiny_folder), "--data", str(bad), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "missing key(s) chosen, rejected" in err
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"rlhf": {"num_generation": 3}}))
    assert main(["rlhf", "grpo", "--model", str(tiny_folder), "--config", str(cfg), "--out", str(tmp_path)]) == 2
    assert "rlhf.num_generation" in capsys.readouterr().err
