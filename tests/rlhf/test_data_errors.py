"""`zeal rlhf` data that is wrong: every row's keys *and types* are checked before a model
is loaded, and a bad row is one line naming the file, the line and the key (issue 31:
these ended in TypeError, RecursionError, jinja2's UndefinedError, ModuleNotFoundError).
A start that fails leaves the earlier results in ``--out`` as they were; a fresh start
into a folder with earlier results moves them aside and says so; degenerate preference
pairs warn."""

from __future__ import annotations

import json
import logging

import pytest

from zeal.cli.main import main
from zeal.rlhf.data import read_jsonl

pytestmark = pytest.mark.timeout(90)
PAIR = ("prompt", "chosen", "rejected")


@pytest.mark.parametrize("row,keys,answer,key,what", [
    ({"messages": "hi"}, ("messages",), False, "messages", "not a non-empty list"),
    ({"messages": [{"role": "user", "content": 5}]}, ("messages",), False, "messages", "'content' is int"),
    ({"messages": [{"role": "user", "content": "hi"}]}, ("messages",), False, "messages", "no assistant turn"),
    ({"prompt": "q", "chosen": 5, "rejected": "b"}, PAIR, False, "chosen", "is int 5"),
    ({"prompt": None, "chosen": "a", "rejected": "b"}, PAIR, False, "prompt", "is NoneType"),
    ({"prompt": "q", "chosen": [[[1]]], "rejected": "b"}, PAIR, False, "chosen", "is list"),
    ({"prompt": [1, 2], "chosen": [{"role": "assistant", "content": "a"}], "rejected": "b"}, PAIR, False, "prompt",
     "token ids beside chat messages"),
    ({"prompt": "What is 1 + 1?", "answer": {"x": 1}}, ("prompt",), True, "answer", 'is dict {"x": 1}'),
    ({"prompt": "  "}, ("prompt",), False, "prompt", "empty"),
])
def test_wrongly_typed_row_is_one_line_naming_file_line_and_key(tmp_path, row, keys, answer, key, what):
    path = tmp_path / "d.jsonl"
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "prompt": "q", "chosen": "a", "rejected": "b", "answer": 2}
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError) as e:
        read_jsonl(path, keys, **({"answer": True} if answer else {}))  # the old signature had no answer
    msg = str(e.value)
    assert msg.startswith(f"{path}:3: key {key!r}: ") and what in msg and "\n" not in msg, msg


def test_deeply_nested_row_is_refused_in_one_line(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text('{"messages": ' + "[" * 100000 + "]" * 100000 + "}\n")
    with pytest.raises(ValueError, match=r"deep.jsonl:1: not JSON \(nested too deeply\)"):
        read_jsonl(path, ("messages",))


def test_degenerate_pairs_warn(tmp_path, caplog):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [
        {"prompt": "q", "chosen": "a", "rejected": "b"}, {"prompt": "q", "chosen": "", "rejected": "b"},
        {"prompt": "q", "chosen": "a", "rejected": "a"}]))
    with caplog.at_level(logging.WARNING, logger="zeal.rlhf"):
        assert len(read_jsonl(path, PAIR)) == 3
    assert "2 of 3 preference rows have an empty answer or chosen equal to rejected (line 2, 3)" in caplog.text


def test_failed_start_keeps_earlier_results_and_fresh_start_moves_them(tmp_path, capsys):
    """Regression: a start failing on its data replaced metrics.csv/jsonl with empty files."""
    from tests.rlhf.conftest import build_tiny_folder

    tiny = build_tiny_folder(tmp_path / "tiny")
    out = tmp_path / "out"
    out.mkdir()
    earlier = {"metrics.csv": "step,kind,loss\n1,train,2.5\n", "metrics.jsonl": '{"step": 1, "loss": 2.5}\n'}
    for name, text in earlier.items():
        (out / name).write_text(text)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "q", "chosen": 5, "rejected": "b"}\n')
    assert main(["rlhf", "dpo", "--model", str(tiny), "--data", str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"zeal rlhf: error: {bad}:1: key 'chosen': is int 5 (expected a string, a list of chat messages " \
                  "or a list of token ids)"
    assert main(["rlhf", "grpo", "--model", str(tiny), "--reward", "no_such_mod:f", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--reward no_such_mod:f: cannot import module 'no_such_mod'" in err
    assert {n: (out / n).read_text() for n in earlier} == earlier
    # a fresh start (no checkpoint) into the folder: the earlier results are moved aside, said once
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "rlhf": {"batch_size": 2}}))
    assert main(["rlhf", "sft", "--model", str(tiny), "--steps", "1", "--out", str(out), "--config", str(cfg)]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "moved the earlier results" in line]
    (aside,) = [p for p in out.iterdir() if p.name.startswith("earlier-")]
    assert len(said) == 1 and str(aside) in said[0] and "metrics.csv, metrics.jsonl" in said[0]
    assert {n: (aside / n).read_text() for n in earlier} == earlier
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1]
