"""Offload tiers on an accelerator (checked on CPU with the device given). Every tier now
crosses from a CUDA device to the host through explicit staging buffers
(tests/zero/test_offload_staging.py runs that path on CPU), so none is refused on CUDA any
more; before, ``offload_param.device: cpu`` silently left the parameters on the GPU and both
NVMe tiers crashed in the swap store ("swap I/O needs a contiguous CPU tensor"), and then
they were refused. A device the staging is not wired for is refused in one line."""

from __future__ import annotations

import pytest
import torch

from zeal.config import ConfigError, load_config
from zeal.zero.apply import check_offload_device

CUDA, CPU, XPU = torch.device("cuda", 0), torch.device("cpu"), torch.device("xpu", 0)
TIERS = [("none", "none"), ("none", "cpu"), ("cpu", "cpu"), ("cpu", "none"), ("nvme", "nvme"), ("none", "nvme"),
         ("nvme", "cpu")]


def _zc(param: str = "none", optimizer: str = "none"):
    return load_config({"zero_optimization": {"stage": 3, "offload_param": {"device": param, "nvme_path": "/tmp"},
                                              "offload_optimizer": {"device": optimizer, "nvme_path": "/tmp"}}}
                       ).zero_optimization


@pytest.mark.parametrize("param, optimizer", TIERS)
def test_every_tier_allowed_on_cpu_and_cuda(param, optimizer):
    check_offload_device(_zc(param, optimizer), CPU)
    check_offload_device(_zc(param, optimizer), CUDA)


@pytest.mark.parametrize("param, optimizer, key", [("cpu", "none", "offload_param"), ("none", "nvme", "offload_optimizer")])
def test_refused_on_an_unwired_accelerator_naming_the_key(param, optimizer, key):
    with pytest.raises(ConfigError, match=f"zero_optimization.{key}.device") as e:
        check_offload_device(_zc(param, optimizer), XPU)
    assert "\n" not in str(e.value) and "xpu" in str(e.value)
    check_offload_device(_zc(), XPU)  # no offload: nothing to refuse
