"""Rank-to-GPU mapping on CUDA machines, checked on CPU with the device count given: more
processes per node than GPUs is one clear error (it was ``local_rank % device_count``, two
ranks on one GPU, an NCCL abort at the first collective), and gloo with CUDA is refused."""

from __future__ import annotations

import pytest
import torch

from zeal.dist.context import check_gpu_ranks, init_distributed


def test_more_ranks_than_gpus_is_one_line_naming_both():
    check_gpu_ranks(1, gpus=1)
    check_gpu_ranks(8, gpus=8)
    with pytest.raises(ValueError, match=r"2 processes per node but 1 GPU\(s\) visible.*--nproc 1") as e:
        check_gpu_ranks(2, gpus=1)
    assert "\n" not in str(e.value)


def test_no_cuda_nothing_to_check(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check_gpu_ranks(64)


def test_init_distributed_refuses_two_ranks_on_one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("set_device reached"))
    monkeypatch.setenv("LOCAL_RANK", "1")  # the second process of a node with one GPU
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=r"2 processes per node but 1 GPU"):
        init_distributed()
