"""Fused CPU kernels for serving, compiled from ``cpu_kernels.cpp`` on first use.

The build (``torch.utils.cpp_extension``, ``-O3 -march=native``, about 25 s on two
cores) runs once per machine, source, torch and Python version; the library is kept under
zeal's cache (``$ZEAL_CACHE/kernels``) and loaded from there by every environment that
matches, whatever its folder. Without a C++ compiler or ``ninja``, or with
``ZEAL_CPU_KERNELS=0``, :func:`cpu_kernels` returns None and callers keep their
pure-torch path, which computes the same thing.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
import time
from pathlib import Path

import torch

from zeal.utils.hardware import cpu_flags
from zeal.utils.paths import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
STALE_LOCK_S = 600.0  # a build takes well under a minute; an older lock was abandoned
_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags."""
    return " ".join([platform.processor() or platform.machine(), *sorted(cpu_flags())])


def _build_name() -> str:
    key = "\n".join([SOURCE.read_text(), torch.__version__, sys.version, _cpu_signature()])
    return "zeal_cpu_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _load() -> object:
    from torch.utils.cpp_extension import load

    name = _build_name()
    build_dir = cache_dir() / "kernels" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    lock = build_dir / "lock"  # torch waits while it exists: one left by a killed build would hang us
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink(missing_ok=True)
    except FileNotFoundError:
        pass
    built = build_dir / f"{name}.so"
    if built.is_file() and not lock.exists():
        # The name already fixes the source, torch and Python versions and the CPU, so a built
        # library serves every environment that has them. cpp_extension.load would run ninja
        # first, whose build file names this environment's torch folder: another virtual
        # environment (a fresh clone's) would rebuild it (~25 s of two cores).
        try:
            torch.ops.load_library(str(built))
            return torch.ops.zeal_cpu
        except OSError as e:  # a library left half-written by a killed build: build it again
            log.warning("zeal: rebuilding the fused CPU kernels (%s)", str(e).splitlines()[0] if str(e) else e)
    else:
        log.warning("zeal: compiling the fused CPU kernels once (%s)", build_dir)
    # Build from a copy kept beside the build: ninja rebuilds when a source's path changes, and
    # the name (a hash of the text) already tells builds apart, so every checkout shares one.
    source = build_dir / SOURCE.name
    text = SOURCE.read_bytes()
    if not source.is_file() or source.read_bytes() != text:
        tmp = build_dir / f"{SOURCE.name}.{os.getpid()}.tmp"
        tmp.write_bytes(text)
        os.replace(tmp, source)
    # -fopenmp links libgomp, which resolves to the copy torch already loaded: one thread pool
    load(name=name, sources=[str(source)], build_directory=str(build_dir), is_python_module=False,
         extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-Wno-psabi"],
         extra_ldflags=["-fopenmp"], verbose=False)
    return torch.ops.zeal_cpu


def wanted() -> bool:
    """Whether this machine is one the kernels are built for, and ``ZEAL_CPU_KERNELS`` is not 0."""
    return os.environ.get("ZEAL_CPU_KERNELS", "1") != "0" and platform.machine() in ("x86_64", "aarch64")


def cpu_kernels() -> object | None:
    """``torch.ops.zeal_cpu`` once built and loaded; None where they can't be (logged once)."""
    with _lock:
        if "ops" not in _state:
            ops = None
            if wanted():
                try:
                    ops = _load()
                except Exception as e:  # no compiler, no ninja, a read-only cache: stay pure torch
                    log.warning("zeal: fused CPU kernels unavailable, using the pure-torch path (%s)",
                                str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
            _state["ops"] = ops
        return _state["ops"]
