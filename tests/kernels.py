"""The fused CPU serving kernels in the test workers: built (or loaded) while tests are
collected, where no per-test timeout runs (a first build takes ~25 s of one core), by one
worker only. Under ``-n 2`` the other worker starts its tests at once and loads the library
when a test first asks for it (waiting for that build if it is still running), instead of
waiting in its own collection with its core idle. A built library loads in ~0.1 s."""

from __future__ import annotations

import importlib.util
import os
import shutil

from zeal.inference.kernels import cpu_kernels, wanted


def build_in_first_worker() -> None:
    """Build or load the kernels now in a serial run or in worker ``gw0``; elsewhere later."""
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0":
        cpu_kernels()


def can_build() -> bool:
    """Whether the kernels build here (what :func:`cpu_kernels` needs), without building them."""
    return (wanted() and shutil.which(os.environ.get("CXX", "c++")) is not None
            and importlib.util.find_spec("ninja") is not None)


class LazyOps:
    """``torch.ops.zeal_cpu``, loaded on the first attribute read (see the module's docstring)."""

    def __getattr__(self, name: str):
        ops = cpu_kernels()
        if ops is None:
            raise RuntimeError("the fused CPU kernels did not build here (see the log above)")
        return getattr(ops, name)
