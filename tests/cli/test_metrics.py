"""Progress bar text, metrics files and the loss plot."""

from __future__ import annotations

import csv
import io
import json

import pytest

from zeal.train.metrics import MetricsSink, ProgressBar, format_duration, plot_loss_curve, read_metrics

pytestmark = pytest.mark.timeout(60)


def test_progress_bar_shows_step_loss_rate_and_eta():
    stream = io.StringIO()
    bar = ProgressBar(100, 0, stream=stream, log_interval=50)
    bar.t0 -= 10.0  # pretend 10 s passed
    line = bar.render(25, 3.14159, 12_345)
    assert "step  25/100" in line and "loss 3.1416" in line and "12.3k tok/s" in line and "ETA 0:30" in line
    for step in range(1, 101):
        bar.update(step, 1.0, 1.0)
    assert len(stream.getvalue().splitlines()) == 2  # not a terminal: every 50 steps
    quiet = io.StringIO()
    ProgressBar(10, enabled=False, stream=quiet).update(10, 1.0, 1.0)
    assert quiet.getvalue() == ""
    assert format_duration(3725) == "1:02:05" and format_duration(float("inf")) == "?"


def test_sink_writes_jsonl_and_csv_and_appends_on_resume(tmp_path):
    sink = MetricsSink(tmp_path)
    sink.log({"step": 1, "kind": "train", "loss": 5.0, "lr": 1e-3, "grad_norm": float("nan")})
    sink.log({"step": 1, "kind": "eval", "loss": 5.5})
    sink.close()
    again = MetricsSink(tmp_path, append=True)
    again.log({"step": 2, "kind": "train", "loss": 4.0})
    again.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 1, 2] and records[0]["grad_norm"] is None
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [r["loss"] for r in rows] == ["5.0", "5.5", "4.0"]
    MetricsSink(tmp_path / "off", enabled=False).log({"step": 1})
    assert not (tmp_path / "off").exists()


def test_resumed_run_keeps_one_row_per_step(tmp_path):
    """Regression (issue 31): a run killed at step 37 (its last line cut short) and resumed
    from the checkpoint of step 20 kept the rows of the redone steps 21-37 (and the eval
    at 20 twice); after the resume both files hold one row per step and kind."""
    sink = MetricsSink(tmp_path)
    for step in range(38):
        if step % 20 == 0:
            sink.log({"step": step, "kind": "eval", "loss": 9.0})
        if step:
            sink.log({"step": step, "kind": "train", "loss": 10.0 - step / 10})
    sink.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 38, "kind": "tr')  # kill -9 mid-write
    with (tmp_path / "metrics.csv").open("a") as f:
        f.write("38,tra")
    again = MetricsSink(tmp_path, append=True)
    again.rewind(20)
    again.log({"step": 20, "kind": "eval", "loss": 8.0})
    for step in range(21, 41):
        again.log({"step": step, "kind": "train", "loss": 1.0})
    again.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    for got in (records, rows):
        keys = [(int(r["step"]), r["kind"]) for r in got]
        assert len(keys) == len(set(keys)) == 40 + 2
        assert [int(r["step"]) for r in got if r["kind"] == "train"] == list(range(1, 41))
        assert [float(r["loss"]) for r in got if r["kind"] == "train"][19:21] == [8.0, 1.0]
        assert [float(r["loss"]) for r in got if r["kind"] == "eval"] == [9.0, 8.0]


def test_loss_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": i, "kind": "train", "loss": 5 - i / 10}) + "\n" for i in range(20)))
    png = plot_loss_curve(path, tmp_path / "loss.png")
    assert png is not None and png.read_bytes()[:4] == b"\x89PNG"
