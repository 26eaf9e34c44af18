"""The README cannot drift from the code: every ``zeal ...`` command in its shell blocks
(and in those of the ``docs/`` pages it links to)
parses with the real command-line parser (every flag exists, every choice is valid,
dotted ``zeal train`` overrides name real keys), every subcommand it uses answers
``--help``, and the cheap ones run: ``zeal train`` commands build their validated job
spec where the files they name exist, ``zeal estimate`` commands run to the end."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from zeal.cli.main import COMMANDS, build_parser, main

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))  # the reference pages the README links to
_BLOCK = re.compile(r"^```(?:bash|sh|shell|console)\n(.*?)^```", re.S | re.M)


def readme_commands(text: str) -> list[list[str]]:
    """argv (after ``zeal``) of every zeal command in the shell blocks of ``text``:
    comments dropped, ``a; b``, ``a && b`` and ``a &`` split, ``x|y|z`` alternatives expanded."""
    out = []
    for block in _BLOCK.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            try:
                tokens = shlex.split(line, comments=True)
            except ValueError:
                continue
            cur: list[list[str]] = [[]]
            for tok in tokens:
                if tok in (";", "&&", "||", "&") or tok.endswith(";"):
                    if tok.endswith(";") and tok != ";":
                        cur[-1].append(tok[:-1])
                    cur.append([])
                else:
                    cur[-1].append(tok)
            for seg in cur:
                starts = [i for i, t in enumerate(seg) if t == "zeal" or t.endswith("/zeal")]
                if not starts:
                    continue
                argv = seg[starts[0] + 1:]
                alts = [i for i, t in enumerate(argv) if "|" in t and not t.startswith("-")]
                if alts:
                    i = alts[0]
                    out += [argv[:i] + [alt] + argv[i + 1:] for alt in argv[i].split("|")]
                else:
                    out.append(argv)
    return out


COMMAND_LINES = readme_commands(README.read_text()) + [a for d in DOCS for a in readme_commands(d.read_text())]


def test_the_readme_has_zeal_commands_and_the_extractor_reads_them():
    assert len(COMMAND_LINES) >= 10
    assert readme_commands("```bash\nzeal a --x 1   # c\nfoo; .venv/bin/zeal b|c -y && zeal d\nzeal e P &\n```\n") == [
        ["a", "--x", "1"], ["b", "-y"], ["c", "-y"], ["d"], ["e", "P"]]


@pytest.mark.parametrize("argv", COMMAND_LINES, ids=[" ".join(a)[:60] for a in COMMAND_LINES])
def test_readme_command_parses(argv, tmp_path, monkeypatch):
    if not argv:
        pytest.skip("bare `zeal`")
    assert argv[0] in COMMANDS, f"README runs an unknown command: zeal {' '.join(argv)}"
    parser, module = build_parser(argv[0])
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit as e:
        pytest.fail(f"README command does not parse (exit {e.code}): zeal {' '.join(argv)}")
    if not getattr(args, "_allow_extra", False):
        assert not extra, f"README command has flags the parser does not know: {extra}"
    files = [t for t in argv[1:] if re.search(r"\.(json|jsonl|ya?ml|txt|gguf)$", t)]
    if argv[0] == "train" and not args.resume and all(Path(f).exists() for f in files):
        from zeal.cli.train import build_spec

        monkeypatch.chdir(tmp_path)
        build_spec(args, extra)  # every flag and dotted override validated, as at start-up


@pytest.mark.parametrize("command", sorted({a[0] for a in COMMAND_LINES if a and a[0] in COMMANDS}))
def test_readme_subcommand_answers_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0 and f"zeal {command}" in capsys.readouterr().out


def test_readme_estimate_commands_run(tmp_path, monkeypatch, capsys):
    ran = 0
    for argv in COMMAND_LINES:
        if argv[:1] != ["estimate"]:
            continue
        if "--hf-config" in argv:  # a Llama-2-7B-shaped config.json stands in for the reader's
            cfg = tmp_path / "config.json"
            cfg.write_text('{"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, '
                           '"num_hidden_layers": 32, "num_attention_heads": 32, "vocab_size": 32000}')
            argv = [str(cfg) if a.endswith("config.json") else a for a in argv]
        assert main(argv) == 0, f"zeal {' '.join(argv)}"
        assert "per rank" in capsys.readouterr().out
        ran += 1
    assert ran >= 1
