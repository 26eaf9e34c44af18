"""``deepspeed.constants``: the launcher and process-group constants DeepSpeed 0.19 exports.

Scripts import these (``from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT,
CROSS_RANK, CROSS_SIZE``) to read the environment the launcher sets; the values are
DeepSpeed's. ``default_pg_timeout`` honours ``DEEPSPEED_TIMEOUT`` (minutes) as DeepSpeed does."""

from __future__ import annotations

import os
from datetime import timedelta

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500
default_pg_timeout = timedelta(minutes=int(os.getenv("DEEPSPEED_TIMEOUT", "10")))
INFERENCE_GENERIC_MODE = "generic"
INFERENCE_SPECIALIZED_MODE = "specialized"
CROSS_RANK = "CROSS_RANK"  # environment variables the multi-node launcher sets
CROSS_SIZE = "CROSS_SIZE"
LOCAL_RANK = "LOCAL_RANK"
