"""What a training job shows and records: a console progress bar, a metrics sink
(JSONL + CSV, and the trackers of ``job.report_to``: :mod:`zeal.train.reporters`) and a loss-curve PNG (matplotlib when
installed). Only rank 0 creates these with ``enabled=True``; other ranks get
inert objects, so the loop calls them unconditionally.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

CSV_COLUMNS = ("step", "kind", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "tflops", "mfu", "elapsed_s",
               "curriculum_difficulty", "random_ltd_kept_tokens")


def format_duration(seconds: float) -> str:
    """``75.2`` → ``"1:15"``, ``3725`` → ``"1:02:05"``."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def format_rate(x: float) -> str:
    """Tokens/s with a k/M suffix."""
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e3:
        return f"{x / 1e3:.1f}k"
    return f"{x:.0f}"


class ProgressBar:
    """Step, loss, tokens/s and ETA on one line. On a terminal the line redraws in
    place; otherwise (a log file, a pipe) a line is printed every ``log_interval``
    steps and at the end."""

    def __init__(self, total: int, start: int = 0, *, enabled: bool = True, log_interval: int = 10,
                 stream: TextIO | None = None, width: int = 24) -> None:
        self.total, self.start, self.enabled = total, start, enabled
        self.log_interval, self.width = log_interval, width
        self.stream = stream or sys.stdout
        self.tty = enabled and self.stream.isatty()
        self.t0 = time.perf_counter()
        self._last = ""

    def render(self, step: int, loss: float, tokens_per_s: float) -> str:
        """The bar's text for ``step`` of ``total``."""
        frac = step / self.total if self.total else 1.0
        filled = int(round(frac * self.width))
        elapsed = time.perf_counter() - self.t0
        done = step - self.start
        eta = elapsed / done * (self.total - step) if done > 0 else math.inf
        bar = "#" * filled + "." * (self.width - filled)
        return (f"step {step:>{len(str(self.total))}}/{self.total} [{bar}] loss {loss:.4f} | "
                f"{format_rate(tokens_per_s)} tok/s | elapsed {format_duration(elapsed)} | ETA {format_duration(eta)}")

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if not self.enabled:
            return
        self._last = self.render(step, loss, tokens_per_s)
        if self.tty:
            self.stream.write("\r" + self._last + "\x1b[K")
            self.stream.flush()
        elif step % self.log_interval == 0 or step == self.total:
            print(self._last, file=self.stream, flush=True)

    def write(self, line: str) -> None:
        """Print a line without breaking the bar."""
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r\x1b[K" + line + "\n" + self._last)
            self.stream.flush()
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


class MetricsSink:
    """Appends each record to ``metrics.jsonl`` and ``metrics.csv`` in the run folder,
    and to the trackers ``report_to`` names (None: TensorBoard in ``<run>/tb`` when the
    ``tensorboard`` package is installed; see :func:`~zeal.train.reporters.open_reporters`).
    A record is a dict with at least ``step``, ``kind`` ("train"/"eval") and ``loss``;
    ``columns`` are the CSV's (other keys go to the JSONL only)."""

    def __init__(self, run_dir: str | Path, *, enabled: bool = True, append: bool = False,
                 report_to: list[str] | None = None, run_config: dict[str, Any] | None = None,
                 columns: tuple[str, ...] = CSV_COLUMNS) -> None:
        self.enabled = enabled
        self.records: list[dict[str, Any]] = []
        if not enabled:
            return
        run = Path(run_dir)
        run.mkdir(parents=True, exist_ok=True)
        self._run, self._columns = run, columns
        self._open(append)
        from zeal.train.reporters import open_reporters

        self.reporters = open_reporters(run, report_to, run_config)

    def _open(self, append: bool) -> None:
        mode = "a" if append else "w"
        csv_path = self._run / "metrics.csv"
        new_csv = not (append and csv_path.exists() and csv_path.stat().st_size > 0)
        self._jsonl = open(self._run / "metrics.jsonl", mode)  # noqa: SIM115 - closed in close()
        self._csv_file = open(csv_path, mode, newline="")  # noqa: SIM115
        self._csv = csv.DictWriter(self._csv_file, fieldnames=self._columns, extrasaction="ignore")
        if new_csv:
            self._csv.writeheader()

    def rewind(self, step: int) -> None:
        """A run resumed from the checkpoint of ``step`` redoes what came after it: drop
        from ``metrics.jsonl`` and ``metrics.csv`` every record past ``step``, and the
        records at ``step`` other than ``train`` ones (an evaluation there is redone), so
        the files hold one row per step and kind. A line cut short by a killed run is
        dropped too. Each file is rewritten whole, then renamed over the old one."""
        if not self.enabled:
            return
        self._jsonl.close()
        self._csv_file.close()

        def keep(rec_step: Any, kind: Any) -> bool:
            try:
                n = int(rec_step)
            except (TypeError, ValueError):
                return False
            return n < step or (n == step and kind == "train")

        path = self._run / "metrics.jsonl"
        lines = []
        for line in path.read_text(errors="replace").splitlines() if path.exists() else ():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and keep(rec.get("step"), rec.get("kind")):
                lines.append(line + "\n")
        _replace(path, "".join(lines))
        path = self._run / "metrics.csv"
        rows = []
        if path.exists():
            with path.open(newline="", errors="replace") as f:
                rows = list(csv.reader(f))
        out = [rows[0]] if rows else []
        if rows and "step" in rows[0]:
            at, kind_at = rows[0].index("step"), rows[0].index("kind") if "kind" in rows[0] else None
            out += [r for r in rows[1:] if len(r) == len(rows[0])
                    and keep(r[at], r[kind_at] if kind_at is not None else "train")]
        text = io.StringIO()
        csv.writer(text).writerows(out)
        _replace(path, text.getvalue())
        self.records = [r for r in self.records if keep(r.get("step"), r.get("kind"))]
        self._open(append=True)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self.records.append(record)
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        self._csv.writerow(record)
        self._csv_file.flush()
        for reporter in self.reporters:
            reporter.log(record)

    def close(self) -> None:
        if not self.enabled:
            return
        self._jsonl.close()
        self._csv_file.close()
        for reporter in self.reporters:
            reporter.close()


def _replace(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed over it."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a ``metrics.jsonl`` file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_loss_curve(metrics_jsonl: str | Path, out_png: str | Path, x: str = "step") -> Path | None:
    """Train and held-out loss against ``x`` (``step``, or ``tokens``: consumed tokens) as a
    PNG; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    records = read_metrics(metrics_jsonl)
    train = [(r[x], r["loss"]) for r in records
             if r.get("kind") == "train" and r.get("loss") is not None and r.get(x) is not None]
    held = [(r[x], r["loss"]) for r in records
            if r.get("kind") == "eval" and r.get("loss") is not None and r.get(x) is not None]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train", linewidth=1)
    if held:
        ax.plot(*zip(*held), "o-", label="held-out", linewidth=1.5)
    ax.set_xlabel("consumed tokens" if x == "tokens" else x)
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(out_png)
    fig.savefig(out)
    plt.close(fig)
    return out
