"""Tiny models: one thread each (threads only contend on a shared CI machine), and the
fused CPU kernels built while tests are collected (outside any per-test timeout)."""

from __future__ import annotations

import pytest
import torch

from zeal.inference.kernels import cpu_kernels

cpu_kernels()


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
