"""One typed, validated configuration tree (pydantic v2, unknown keys refused).

Its sections, each a model with a description on every field:

* :class:`Config` (``schema.py``): the training engine, in DeepSpeed's JSON keys;
* :class:`JobSpec` (``job.py``): a ``zeal train`` job: ``model``, ``data``, ``job``,
  ``engine`` (a :class:`Config` as written) and ``process``;
* :class:`InferenceConfig` (``inference.py``): ``zeal serve`` and the serving engine;
* :class:`RLHFConfig` (``rlhf.py``): the ``rlhf`` section of ``zeal rlhf``'s jobs;
* :class:`ProcessConfig` (``process.py``): process-wide settings, shared by both commands.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from zeal.config.ds_compat import AutoValues, translate
from zeal.config.inference import InferenceConfig
from zeal.config.job import JobSpec
from zeal.config.process import ProcessConfig
from zeal.config.rlhf import RLHFConfig
from zeal.config.schema import Config, ZeroConfig

__all__ = ["AutoValues", "Config", "ZeroConfig", "ConfigError", "InferenceConfig", "JobSpec", "ProcessConfig",
           "RLHFConfig", "load_config"]

log = logging.getLogger("zeal")


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key path and the rule, on
    one line (whitespace runs, newlines included, become one space), as the CLI prints it."""

    def __init__(self, message: object = "") -> None:
        super().__init__(" ".join(str(message).split()))


def load_config(source: Config | dict[str, Any] | str | os.PathLike | None, auto: AutoValues | None = None) -> Config:
    """Build a :class:`Config` from a dict, a JSON/YAML file or an existing Config.

    DeepSpeed's ``"auto"`` values take the job's own values given in ``auto`` (as the
    Hugging Face integration fills them from its ``TrainingArguments``); one that nothing
    gives is a :class:`ConfigError` naming the key (see :mod:`zeal.config.ds_compat`)."""
    if source is None:
        return Config()
    if isinstance(source, Config):
        return source
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        text = path.read_text()
        try:
            if path.suffix in (".yaml", ".yml"):
                import yaml

                raw = yaml.safe_load(text)
            else:
                raw = json.loads(text)
        except Exception as e:  # noqa: BLE001 - parser errors vary by format
            raise ConfigError(f"config file {str(path)!r} is not valid {path.suffix.lstrip('.') or 'JSON'}: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
        source = raw
    if not isinstance(source, dict):
        raise ConfigError(f"config must be a dict, a path or a zeal.Config, got {type(source).__name__}")
    try:
        cfg, notes = translate(source, auto)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for n in notes:
        _note_once(n)
    try:
        return Config.model_validate(cfg)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None


_SAID: set[str] = set()


def _note_once(note: str) -> None:
    """Log a compatibility note the first time this process meets it."""
    if note not in _SAID:
        _SAID.add(note)
        log.info(note)


def format_validation_error(e: ValidationError) -> str:
    """One line per problem: ``key.path: message (got value)``."""
    lines = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        msg = err["msg"]
        own = str(err.get("ctx", {}).get("error", "")) if err["type"] == "value_error" else ""
        if own.startswith("config key '"):  # zeal's own validators name the key themselves
            lines.append(own)
            continue
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        got = err.get("input")
        suffix = f" (got {got!r})" if err["type"] != "extra_forbidden" and not isinstance(got, dict) else ""
        lines.append(f"config key '{loc}': {msg}{suffix}")
    return "; ".join(lines)
