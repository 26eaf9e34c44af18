"""``zeal ARGS`` run in the test's own process, through the console script's ``main``.

What a subprocess adds is an interpreter start and its imports (2-3 s a command); a test
that checks a command's exit status, output and files gets nothing else from it. The
ranks a command starts (``--nproc 2``: torchrun and its processes) are real processes
still; their output reaches the test through ``capfd``, as the command's own does.
"""

from __future__ import annotations

import os

import pytest
import torch


def zeal_here(capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, *args: str,
              cache: str | None = None) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``zeal ARGS`` (``cache``: its ``ZEAL_CACHE``)."""
    from zeal.cli.main import main

    if cache is not None:
        monkeypatch.setenv("ZEAL_CACHE", cache)
    # the command sets THP_MEM_ALLOC_ENABLE for its process and its ranks (zeal.utils.process):
    # set here so that monkeypatch restores the test process's environment afterwards
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", os.environ.get("THP_MEM_ALLOC_ENABLE", "1"))
    monkeypatch.setenv("PYTHONWARNINGS", "ignore::FutureWarning")  # for the ranks, as the tests' subprocesses had
    capfd.readouterr()
    with torch.random.fork_rng():  # a job seeds torch's generator: the test process's is left as it was
        try:
            rc = main(list(args))
        except SystemExit as e:  # argparse, or a launcher whose ranks failed
            rc = e.code if isinstance(e.code, int) else 1
    out, err = capfd.readouterr()
    return rc, out, err
