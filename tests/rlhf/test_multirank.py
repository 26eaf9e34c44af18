"""`zeal rlhf ... --nproc 2`: two torchrun ranks under ZeRO-2 (GRPO) and ZeRO-3 (DPO) on a
tiny Llama. The run completes, rank 0 alone writes the metrics, and the per-step figures
equal one process's on the same global batch (each rank takes its slice of the batch one
process would draw; gradients are averaged over the ranks). Also: the CLI's
``--generation-dtype`` and ``--zero-stage`` reach the job's config."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.rlhf.conftest import build_tiny_folder
from zeal.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = build_tiny_folder(tmp_path_factory.mktemp("tiny"))
    for per_rank in (1, 2):  # batch_size is per rank: 2 ranks x 1 against 1 process x 2
        (d / f"ds{per_rank}.json").write_text(json.dumps({
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "rlhf": {"batch_size": per_rank, "num_generations": 2, "max_new_tokens": 4}}))
    return d


def _two_ranks(argv: list[str], timeout: float = 90.0) -> str:
    """``zeal rlhf ... --nproc 2`` in a process group of its own (killed whole on timeout)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "zeal.cli.main", "rlhf", *argv, "--nproc", "2"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        pytest.fail(f"zeal rlhf {argv[0]} --nproc 2 did not finish in {timeout} s")
    assert p.returncode == 0, err[-2000:]
    return out


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _compare(two: list[dict], one: list[dict], keys: tuple[str, ...], tol: float) -> None:
    assert [r["step"] for r in two] == [r["step"] for r in one]  # one record per step: rank 0 alone wrote
    for a, b in zip(two, one):
        for k in keys:
            assert a[k] == pytest.approx(b[k], abs=tol), (a["step"], k, a[k], b[k])


def test_grpo_two_ranks_zero2_equals_one_process(tiny, tmp_path, capsys):
    common = ["--model", str(tiny), "--steps", "2", "--zero-stage", "2", "--generation-dtype", "fp32",
              "--reward", "zeal.rlhf.tasks:graded_arithmetic_reward"]
    stdout = _two_ranks(["grpo", *common, "--out", str(tmp_path / "two"), "--config", str(tiny / "ds1.json")])
    assert stdout.count("[grpo] step 1/2") == 1 and stdout.count("zeal rlhf grpo:") == 1
    assert main(["rlhf", "grpo", *common, "--out", str(tmp_path / "one"), "--config", str(tiny / "ds2.json")]) == 0
    two, one = _metrics(tmp_path / "two"), _metrics(tmp_path / "one")
    # step 1: the same 4 sampled answers and rewards; step 2 samples from the updated weights, and
    # its loss is beta x the k3 KL to the reference (the advantages of a group sum to 0)
    assert one[0]["reward"] > 0 and one[1]["kl"] > 1e-6
    _compare(two, one, ("reward", "loss", "kl", "response_length"), 1e-5)
    assert max(r["logprob_diff"] for r in two) < 1e-4  # fp32 generation: the exact log-prob path
    assert (tmp_path / "two" / "checkpoints" / "latest").exists() and (tmp_path / "two" / "model").is_dir()


def test_dpo_two_ranks_zero3_equals_one_process(tiny, tmp_path):
    common = ["--model", str(tiny), "--steps", "3", "--zero-stage", "3"]
    _two_ranks(["dpo", *common, "--out", str(tmp_path / "two"), "--config", str(tiny / "ds1.json")])
    assert main(["rlhf", "dpo", *common, "--out", str(tmp_path / "one"), "--config", str(tiny / "ds2.json")]) == 0
    two, one = _metrics(tmp_path / "two"), _metrics(tmp_path / "one")
    assert abs(one[1]["loss"] - one[0]["loss"]) > 1e-4  # the update moved the loss: steps 2-3 test it
    _compare(two, one, ("loss", "reward", "kl"), 1e-5)


def test_generation_dtype_and_zero_stage_flags_reach_the_config(tiny, tmp_path, monkeypatch, capsys):
    seen = {}

    def fake_grpo(model, reward_fn, prompts, config, out=None):
        seen.update(config)
        raise ValueError("stop here")

    monkeypatch.setattr("zeal.rlhf.grpo_trainer.grpo", fake_grpo)
    argv = ["rlhf", "grpo", "--model", str(tiny), "--out", str(tmp_path), "--config", str(tiny / "ds1.json")]
    assert main([*argv, "--generation-dtype", "bf16", "--zero-stage", "3"]) == 2
    assert seen["rlhf"]["generation_dtype"] == "bf16" and seen["zero_optimization"]["stage"] == 3
    seen.clear()
    assert main(argv) == 2
    assert seen["rlhf"]["generation_dtype"] == "auto" and seen["zero_optimization"]["stage"] == 0
    with pytest.raises(SystemExit) as e:
        main([*argv, "--generation-dtype", "fp16"])
    assert e.value.code == 2
    assert "invalid choice: 'fp16'" in capsys.readouterr().err
