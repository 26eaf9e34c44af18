"""What this machine computes natively: the CPU's feature flags and bf16 support.

The one bf16 detector of zeal: ``zeal train --precision auto`` and
``zeal serve --dtype auto`` both ask :func:`native_bf16`.
"""

from __future__ import annotations

from pathlib import Path

# x86 AVX512-BF16 or AMX-BF16 dot products; Arm's BF16 extension (e.g. Graviton 3)
_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags (x86 ``flags``, Arm ``Features``) from ``/proc/cpuinfo``
    (or from the text given); empty where it can't be read."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[-1].split())
    return flags


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bf16 in hardware (elsewhere bf16 on CPU is emulated
    and slower than fp32)."""
    return bool(cpu_flags(cpuinfo) & _BF16_FLAGS)


def native_bf16(device: str | None = None) -> bool:
    """Whether ``device`` computes bf16 natively: a CUDA GPU with bf16, or a CPU with
    bf16 dot products. ``None``: the CUDA GPU when there is one, else the CPU."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return str(device) == "cpu" and cpu_has_native_bf16()
