"""Tools, verifiers and reward functions from the config and the CLI (``rlhf.tools``,
``rlhf.verifiers``, ``rlhf.reward_funcs``; ``zeal rlhf grpo --tools calculator,retrieval
--verifiers math``): the flags reach the config and the rows go whole to GRPO, bad names fail
at start-up in one line, and a config naming the calculator plays the same multi-turn
episodes (same rewards) as the environment given in Python."""

import pytest
import torch

from tests.rlhf.test_multiturn import _arith_rows, make_tokenizer
from zeal.rlhf import tools, verifiers
from zeal.rlhf.multiturn import ToolEnv

pytestmark = pytest.mark.timeout(120)


def _fake_grpo(seen):
    def fake(model, reward_fn, prompts, config, out=None):
        seen.update(config=config, reward_fn=reward_fn, prompts=prompts)
        raise ValueError("stop here")

    return fake


def test_cli_tools_and_verifiers_reach_grpo(tmp_path, monkeypatch):
    from tests.rlhf.conftest import build_tiny_folder
    from zeal.cli.main import main

    tiny = build_tiny_folder(tmp_path / "tiny")
    doc = tmp_path / "notes.txt"
    doc.write_text("Paris is the capital of France.\n\nThe Nile is a river.\n")
    seen: dict = {}
    monkeypatch.setattr("zeal.rlhf.grpo_trainer.grpo", _fake_grpo(seen))
    argv = ["rlhf", "grpo", "--model", str(tiny), "--out", str(tmp_path / "run")]
    assert main([*argv, "--tools", "calculator,retrieval", "--retrieval-file", str(doc), "--verifiers", "math"]) == 2
    rc = seen["config"]["rlhf"]
    assert rc["tools"] == ["calculator", "retrieval"] and rc["verifiers"] == ["math"]
    assert rc["retrieval_file"] == str(doc)
    # whole rows (their answers read by the verifier), no default reward beside the verifier
    assert isinstance(seen["prompts"][0], dict) and "answer" in seen["prompts"][0] and seen["reward_fn"] is None
    seen.clear()
    assert main([*argv, "--tools", "calculator"]) == 2  # no verifier: the task's arithmetic check
    assert seen["reward_fn"].__name__ == "arithmetic_reward" and seen["config"]["rlhf"]["verifiers"] == []
    seen.clear()
    assert main(argv) == 2  # without them: text prompts, as before
    assert isinstance(seen["prompts"][0], str) and seen["config"]["rlhf"]["tools"] == []


@pytest.mark.parametrize("extra, message", [
    (["--tools", "calculator,web"], "unknown tool 'web'"),
    (["--tools", "retrieval"], "needs rlhf.retrieval_file"),
    (["--verifiers", "proof"], "unknown verifier 'proof'"),
])
def test_cli_bad_tools_fail_at_start_up(tmp_path, monkeypatch, capsys, extra, message):
    from zeal.cli.main import main

    seen: dict = {}
    monkeypatch.setattr("zeal.rlhf.grpo_trainer.grpo", _fake_grpo(seen))
    assert main(["rlhf", "grpo", "--out", str(tmp_path / "run"), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert not seen and len(err) == 1 and message in err[0], err


def test_config_rewards_and_columns():
    from types import SimpleNamespace

    from zeal.rlhf.grpo_trainer import score
    from zeal.rlhf.hybrid import Rollout

    rc = SimpleNamespace(verifiers=["math"], reward_funcs=["zeal.rlhf.tasks:arithmetic_reward"])
    fns = verifiers.config_rewards(None, rc)
    assert fns == [verifiers.math_answer_reward, __import__("zeal.rlhf.tasks").rlhf.tasks.arithmetic_reward]
    assert verifiers.config_rewards(len, SimpleNamespace(verifiers=[], reward_funcs=[])) is len
    seen = {}

    def fn(prompts, completions, answer=None, **kw):
        seen["answer"] = answer
        return [0.0] * len(completions)

    rows = [{"prompt": "What is 2+3 ?", "answer": 5}, {"prompt": "What is 4*2 ?", "answer": 8}]
    ros = [Rollout([1], [2], [0.0], "5", "stop", 0), Rollout([1], [2], [0.0], "7", "stop", 1)]
    assert score([fn] + fns, rows, ros).tolist() == pytest.approx([2.1, 0.0])  # math 1 + arithmetic 1.1 (the bare number)
    assert seen["answer"] == [5, 8]  # TRL's dataset columns


def _tiny(vocab):
    from zeal.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                             eos_token_id=1))


def test_config_tools_play_the_same_episodes_as_the_python_environment(tmp_path):
    from zeal.rlhf import grpo

    tok, vocab = make_tokenizer()
    rc = {"steps": 3, "batch_size": 4, "num_generations": 4, "max_new_tokens": 1, "max_turns": 2, "beta": 0.0,
          "generation_dtype": "fp32", "loss_type": "dapo", "seed": 1}
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    fns, specs = tools.builtin_tools()

    def env(row):
        return ToolEnv(tok, row, fns, specs, [verifiers.math_answer_reward], tool_reward=0.5)

    py = grpo(_tiny(vocab), None, _arith_rows(), {**cfg, "rlhf": rc}, tokenizer=tok, eos_token_ids=[1],
              environment=env, out=str(tmp_path / "py"))
    conf = grpo(_tiny(vocab), None, _arith_rows(),
                {**cfg, "rlhf": {**rc, "tools": ["calculator"], "verifiers": ["math"], "tool_reward": 0.5}},
                tokenizer=tok, eos_token_ids=[1], out=str(tmp_path / "conf"))
    assert [r["reward"] for r in conf.metrics] == pytest.approx([r["reward"] for r in py.metrics], abs=1e-6)
    assert [r["tool_calls"] for r in conf.metrics] == [r["tool_calls"] for r in py.metrics]
    assert sum(r["tool_calls"] for r in conf.metrics) > 0  # the calculator ran: the multi-turn loop was reached
    with pytest.raises(ValueError, match="needs a reward function"):
        grpo(_tiny(vocab), None, _arith_rows(), {**cfg, "rlhf": rc}, tokenizer=tok, eos_token_ids=[1])


def test_cli_tools_run_reaches_the_multiturn_loop(tmp_path):
    """``zeal rlhf grpo --tools calculator --verifiers math`` end to end on a tiny model of
    the calculator task: the episodes call the tool (``tool_calls`` logged)."""
    import json

    from zeal.cli.main import main
    from zeal.rlhf.tasks import calculator_task

    tok, rows, vocab = calculator_task()
    d = tmp_path / "calc"
    _tiny(vocab).save_hf_folder(d)
    tok.tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(tok.config))
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"rlhf": {"batch_size": 4, "num_generations": 4, "max_new_tokens": 1, "max_turns": 2,
                                        "beta": 0.0, "generation_dtype": "fp32", "seed": 1}}))
    out = tmp_path / "run"
    assert main(["rlhf", "grpo", "--model", str(d), "--data", str(data), "--config", str(cfg), "--steps", "3",
                 "--tools", "calculator", "--verifiers", "math", "--out", str(out)]) == 0
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 3 and sum(r["tool_calls"] for r in recs) > 0
