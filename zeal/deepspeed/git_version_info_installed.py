"""``deepspeed.git_version_info_installed``: what an installed DeepSpeed records about its build.

zeal builds no DeepSpeed ops: ``installed_ops`` is empty (no op was prebuilt, none is
JIT-built either; zeal's optimizers are torch's), ``accelerator_name`` is the device zeal's
accelerator reports, ``torch_info`` the running torch's versions."""

from __future__ import annotations

import torch

version = "0.19.8+zeal"
git_hash = None
git_branch = None
installed_ops: dict[str, bool] = {}
accelerator_name = "cuda" if torch.cuda.is_available() else "cpu"
torch_info = {"version": ".".join(torch.__version__.split("+")[0].split(".")[:2]),
              "bf16_support": True,
              "cuda_version": torch.version.cuda or "0.0",
              "nccl_version": "0.0", "hip_version": getattr(torch.version, "hip", None) or "0.0"}
