"""Experiment trackers a job's metrics also go to (``job.report_to``), beside the
run folder's ``metrics.csv`` / ``metrics.jsonl``.

- ``tensorboard``: event files in ``RUN/tb`` (``torch.utils.tensorboard``, which needs
  the ``tensorboard`` package).
- ``wandb``: Weights & Biases in offline mode (``RUN/wandb``; no network; upload later
  with ``wandb sync``); ``$WANDB_MODE`` set by the user wins.

A tracker whose package is missing is skipped with one line saying so; a tracker
never stops training. Only rank 0 opens trackers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

REPORTERS = ("tensorboard", "wandb")
SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mfu")
_PIP = {"tensorboard": "tensorboard", "wandb": "wandb"}


class Reporter(Protocol):
    """Receives every metrics record (``step``, ``kind`` and the figures) until closed."""

    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    """``{"train/loss": ...}``: the numeric figures of a record, named by kind."""
    return {f"{record['kind']}/{k}": record[k] for k in SCALARS
            if isinstance(record.get(k), (int, float)) and not isinstance(record.get(k), bool)}


class TensorBoardReporter:
    """Scalars to ``RUN/tb`` through ``torch.utils.tensorboard.SummaryWriter``."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tb"))

    def log(self, record: dict[str, Any]) -> None:
        for name, value in _scalars(record).items():
            self.writer.add_scalar(name, value, record["step"])

    def close(self) -> None:
        self.writer.close()


class WandbReporter:
    """Scalars to a Weights & Biases run, offline (``RUN/wandb``) unless ``$WANDB_MODE`` says otherwise."""

    def __init__(self, run_dir: Path, config: dict[str, Any] | None) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "zeal"), name=run_dir.name,
                              dir=str(run_dir), mode=os.environ.get("WANDB_MODE", "offline"),
                              config=config or {})

    def log(self, record: dict[str, Any]) -> None:
        self.run.log(_scalars(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


def open_reporters(run_dir: str | Path, report_to: list[str] | None, config: dict[str, Any] | None = None,
                   say: Any = print) -> list[Reporter]:
    """The trackers ``report_to`` names (None: TensorBoard if installed, silently);
    those whose package is missing are skipped with a line through ``say``."""
    run = Path(run_dir)
    explicit = report_to is not None
    out: list[Reporter] = []
    for name in (report_to if explicit else ["tensorboard"]):
        if name not in REPORTERS:
            raise ValueError(f"job.report_to: unknown tracker {name!r} (known: {', '.join(REPORTERS)})")
        try:
            out.append(TensorBoardReporter(run) if name == "tensorboard" else WandbReporter(run, config))
        except ImportError as e:
            if explicit:
                say(f"zeal train: report_to {name} skipped: the '{e.name or _PIP[name]}' package is not installed "
                    f"(pip install {_PIP[name]}); metrics are in metrics.csv / metrics.jsonl", flush=True)
        except Exception as e:  # noqa: BLE001 - a tracker never stops training
            say(f"zeal train: report_to {name} skipped: {type(e).__name__}: {' '.join(str(e).split())}", flush=True)
    return out
