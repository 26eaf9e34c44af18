"""``deepspeed.git_version_info``: the version fields DeepSpeed reads at import
(``version``, ``git_hash``, ``git_branch``) and its build record
(:mod:`zeal.deepspeed.git_version_info_installed`)."""

from __future__ import annotations

from zeal.deepspeed.git_version_info_installed import (  # noqa: F401  (re-exported, as DeepSpeed's)
    accelerator_name,
    git_branch,
    git_hash,
    installed_ops,
    torch_info,
    version,
)
