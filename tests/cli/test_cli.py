"""`zeal --help`, `zeal train --help`, and bad input: one line naming the problem, exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zeal.cli.main import COMMANDS, main
from zeal.cli.overrides import UsageError

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]


def test_top_level_help_lists_every_command_on_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in ("train", "generate", "serve", "estimate", "launch", "checkpoint", "bench"):
        lines = [ln for ln in out.splitlines() if ln.strip().startswith(name + " ")]
        assert len(lines) == 1 and len(lines[0].split(None, 1)[1]) > 10, name
    assert main([]) == 0  # bare `zeal` prints the same help


def test_train_help_lists_flags_and_commands(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for flag in ("--config", "--nproc", "--steps", "--zero-stage", "--resume", "--model PATH", "--data FILE"):
        assert flag in out
    assert all(f"  {name} " in out for name in COMMANDS)


def test_console_script_runs_from_a_subprocess():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "zeal.cli.main", "--help"], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=60)
    assert r.returncode == 0 and "estimate" in r.stdout


@pytest.mark.parametrize("argv, needle", [
    (["train", "--zero-stage", "5"], "--zero-stage"),
    (["train", "--model.n_layr", "8"], "model.n_layr"),
    (["train", "--bogus", "1"], "--bogus"),
    (["train", "--steps", "-1"], "job.steps"),
    (["train", "--model.n_embd", "100", "--model.n_head", "3"], "model.n_embd 100"),
    (["train", "--zero_optimization.stagee", "2"], "zero_optimization.stagee"),
    (["train", "--micro-batch", "3", "--train_batch_size", "16"], "train_batch_size 16"),
    (["train", "--job.precision", "fp8"], "job.precision"),
    (["train", "--config", "/nonexistent.json"], "/nonexistent.json"),
    (["train", "--model", "/nonexistent"], "/nonexistent"),
    (["train", "--steps"], "--steps"),
    (["estimate", "--budget", "lots"], "--budget"),
    (["estimate", "--n-embd", "100", "--n-head", "3"], "--n-head"),
    (["generate", "--checkpoint", "/nonexistent"], "--checkpoint"),
    (["launch"], "nothing to launch"),
    (["bogus"], "bogus"),
])
def test_bad_input_is_one_line_naming_it(argv, needle, capsys):
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err, err


def test_bad_config_file_values_are_named(tmp_path, capsys):
    bad_json = tmp_path / "a.json"
    bad_json.write_text("{not json")
    bad_stage = tmp_path / "b.json"
    bad_stage.write_text(json.dumps({"zero_optimization": {"stage": 7}, "model": {"n_layer": 2}}))
    bad_section = tmp_path / "c.yaml"
    bad_section.write_text("model:\n  n_layers: 2\n")
    unsupported = tmp_path / "d.json"
    unsupported.write_text(json.dumps({"pipeline": {"stages": 2}}))
    for path, needle in ((bad_json, "a.json"), (bad_stage, "zero_optimization.stage"),
                         (bad_section, "model.n_layers"), (unsupported, "pipeline")):
        assert main(["train", "--config", str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err


def test_config_file_and_flags_build_the_spec(tmp_path):
    from zeal.cli.main import build_parser
    from zeal.cli.train import build_spec

    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({
        "train_batch_size": 32, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 1},
        "model": {"n_layer": 2}, "job": {"steps": 7}, "data": {"seq_len": 64}}))
    parser, _ = build_parser("train")
    args, extra = parser.parse_known_args(["train", "--config", str(cfg), "--model", "gpt", "--zero-stage", "2",
                                           "--model.n_embd", "64", "--job.eval_interval=5",
                                           "--optimizer.params.lr", "3e-4"])
    spec = build_spec(args, extra)
    assert (spec.model.n_layer, spec.model.n_embd, spec.job.steps, spec.job.eval_interval) == (2, 64, 7, 5)
    assert spec.data.seq_len == 64
    e = spec.engine
    assert e["zero_optimization"]["stage"] == 2 and e["train_batch_size"] == 32
    assert "train_micro_batch_size_per_gpu" not in e  # derived from the user's two batch keys
    assert e["optimizer"] == {"type": "Adam", "params": {"lr": 3e-4}}  # a user's optimizer replaces the default
    assert e["scheduler"]["type"] == "WarmupCosineLR" and e["bf16"]["enabled"] in (True, False)


def test_resume_inherits_the_runs_model_and_data(tmp_path):
    from zeal.cli.main import build_parser
    from zeal.cli.train import build_spec
    from zeal.train.job import JobSpec, write_spec

    run = tmp_path / "run"
    write_spec(JobSpec.model_validate({"model": {"n_layer": 6, "n_embd": 64}, "data": {"seq_len": 64},
                                       "job": {"run_dir": str(run), "hf_model": "gpt"}}), run / "config.json")
    parser, _ = build_parser("train")
    args, extra = parser.parse_known_args(["train", "--resume", "--run-dir", str(run), "--model.n_embd", "32",
                                           "--zero-stage", "1"])
    spec = build_spec(args, extra)
    assert (spec.model.n_layer, spec.model.n_embd, spec.data.seq_len) == (6, 32, 64)
    assert spec.engine["zero_optimization"]["stage"] == 1 and spec.job.resume


def test_resume_of_a_fine_tuning_run_keeps_its_model_and_data(tmp_path):
    """`zeal train --resume` of the default job (SmolLM2) or of any fine-tuning run: the model
    and data come from the run, and the run's (unused) GPT shape section is not read back as
    --model.* flags (that refused every fine-tuning resume)."""
    from zeal.cli.main import build_parser
    from zeal.cli.train import build_spec
    from zeal.train.job import JobSpec, write_spec

    run = tmp_path / "run"
    write_spec(JobSpec.model_validate({"data": {"seq_len": 96}, "job": {"run_dir": str(run)}}), run / "config.json")
    parser, _ = build_parser("train")
    spec = build_spec(*parser.parse_known_args(["train", "--resume", "--run-dir", str(run)]))
    assert (spec.job.hf_model, spec.data.seq_len, spec.job.resume) == ("smollm2", 96, True)
    args, extra = parser.parse_known_args(["train", "--resume", "--run-dir", str(run), "--model.n_layer", "2"])
    with pytest.raises(UsageError, match="add --model gpt"):
        build_spec(args, extra)
