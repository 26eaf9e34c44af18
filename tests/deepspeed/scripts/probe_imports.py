"""Prints, as JSON, what ``import deepspeed`` and its submodules resolve to (no training)."""

import importlib.metadata
import importlib.util
import json
import sys

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer  # noqa: F401
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam  # noqa: F401
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec  # noqa: F401
from deepspeed.runtime.lr_schedules import WarmupLR  # noqa: F401
from deepspeed.runtime.pipe.module import PipelineModule as RuntimePipelineModule
from deepspeed.runtime.utils import set_random_seed  # noqa: F401
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # noqa: F401
from deepspeed.utils import RepeatingLoader, groups, log_dist, logger  # noqa: F401

print(json.dumps({
    "name": deepspeed.__name__, "comm": dist.__name__, "same_pipe": RuntimePipelineModule is PipelineModule,
    "version": importlib.metadata.version("deepspeed"), "spec": importlib.util.find_spec("deepspeed") is not None,
    "device": get_accelerator().device_name(), "argv": sys.argv[1:], "main": __name__,
    "has_initialize": callable(deepspeed.initialize),
}))
