"""``zeal serve --dtype auto``: bf16 only where the hardware computes it natively."""

from __future__ import annotations

import pytest

from zeal.cli.serve import resolve_dtype
from zeal.utils.hardware import cpu_has_native_bf16

ZEN4 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
SKYLAKE = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n"
SAPPHIRE = "flags\t\t: avx512f amx_bf16 amx_tile\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


@pytest.mark.parametrize("info,native", [(ZEN4, True), (SKYLAKE, False), (SAPPHIRE, True), (GRAVITON3, True), ("", False)])
def test_native_bf16_from_cpu_flags(info, native):
    assert cpu_has_native_bf16(info) is native


def test_explicit_dtypes_pass_through_and_auto_resolves(monkeypatch):
    assert resolve_dtype("bf16", "cpu") == "bfloat16"
    assert resolve_dtype("fp32", "cpu") == "float32"
    monkeypatch.setattr("zeal.config.inference.cpu_has_native_bf16", lambda: True)
    assert resolve_dtype("auto", "cpu") == "bfloat16"
    monkeypatch.setattr("zeal.config.inference.cpu_has_native_bf16", lambda: False)
    assert resolve_dtype("auto", "cpu") == "float32"
    with pytest.raises(KeyError):
        resolve_dtype("int8", "cpu")
