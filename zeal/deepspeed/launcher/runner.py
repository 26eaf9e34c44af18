"""``deepspeed.launcher.runner``: the constants other launchers import
(``accelerate launch --use_deepspeed`` reads ``DEEPSPEED_ENVIRONMENT_NAME``). Running
DeepSpeed's launcher is ``zeal deepspeed`` (its flags); its functions are refused here."""

from __future__ import annotations

import os
from typing import Any

from zeal.deepspeed.refusals import refuse

DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")  # extra variables for every node
DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]
PDSH_MAX_FAN_OUT = 1024


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return refuse(f"deepspeed.launcher.runner.{name}", "run scripts with `zeal deepspeed` (DeepSpeed's launcher "
                  "flags) or under `python -m zeal.deepspeed`")
