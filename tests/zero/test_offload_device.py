"""Offload tiers on an accelerator (checked on CPU with the device given): the ones that do not
yet cross from the device to the host are refused in one line naming the key — before, at
``initialize`` on CUDA, ``offload_param.device: cpu`` silently left the parameters on the GPU
and both NVMe tiers crashed in the swap store ("swap I/O needs a contiguous CPU tensor")."""

from __future__ import annotations

import pytest
import torch

from zeal.config import ConfigError, load_config
from zeal.zero.apply import check_offload_device

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def _zc(param: str = "none", optimizer: str = "none"):
    return load_config({"zero_optimization": {"stage": 3, "offload_param": {"device": param, "nvme_path": "/tmp"},
                                              "offload_optimizer": {"device": optimizer, "nvme_path": "/tmp"}}}
                       ).zero_optimization


@pytest.mark.parametrize("param, optimizer, key", [("cpu", "none", "offload_param"), ("nvme", "none", "offload_param"),
                                                   ("none", "nvme", "offload_optimizer"),
                                                   ("nvme", "nvme", "offload_param")])
def test_refused_on_an_accelerator_naming_the_key(param, optimizer, key):
    with pytest.raises(ConfigError, match=f"zero_optimization.{key}.device") as e:
        check_offload_device(_zc(param, optimizer), CUDA)
    assert "\n" not in str(e.value) and "cuda" in str(e.value)


def test_allowed_where_it_works():
    for param, optimizer in [("none", "none"), ("none", "cpu"), ("cpu", "cpu"), ("nvme", "nvme")]:
        check_offload_device(_zc(param, optimizer), CPU)  # on a CPU device every tier is whole
    check_offload_device(_zc("none", "cpu"), CUDA)  # ZeRO-Offload of the optimizer: host step
