"""The suite's two tiers (README, "Tests").

- default (``python -m pytest``, what CI runs): every test, property and fuzz tests with a
  small example budget (their ``[ci]`` cases), hypothesis profile ``ci``;
- long (``python -m pytest -m 'fuzz or slow' --hypothesis-profile long``): the same
  property and fuzz tests with their full budgets (their ``[long]`` cases, marked ``fuzz``),
  the tests marked ``slow``, and profile ``long`` for the property tests that name no budget.

A property test that is costly per example takes its budget from :func:`tests.tiers.budget`,
so both tiers run the same test body over the same strategies; only the count differs.
"""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import settings

settings.register_profile("ci", deadline=None, print_blob=True)
settings.register_profile("long", deadline=None, print_blob=True, max_examples=1000)
settings.load_profile("ci")  # --hypothesis-profile long loads the other after this file



if os.environ.get("PYTEST_XDIST_WORKER"):
    # ``-n 2`` (the README's command): each worker's tiny models get one core, not a thread
    # pool that contends with the other worker's for the same two cores. Ranks and
    # subprocesses set their own threads, as in a serial run.
    import torch

    torch.set_num_threads(1)

_RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """A test that joins a process group in the pytest process (``deepspeed.initialize``
    and ``init_distributed`` start a one-rank group and set RANK/WORLD_SIZE, as DeepSpeed's
    do) must not hand it to the next test: a later ``LLM(tensor_parallel_size=2)`` would
    see "world size 1", and ``zeal rlhf`` would think it runs inside a launched rank."""
    before = {k: os.environ.get(k) for k in _RANK_ENV}
    yield
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _time_limit(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is None:
        return 0.0
    value = marker.args[0] if marker.args else marker.kwargs.get("timeout", 0)
    return float(value or 0)


@pytest.hookimpl(trylast=True)  # after ``-m`` has deselected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``-n 2 --dist loadfile`` (the README's command) the files whose tests declare the
    longest time limit (``@pytest.mark.timeout``: the end-to-end runs of ``zeal train``,
    ``zeal serve``, the examples) go first, so the two workers end together instead of one
    finishing a long file alone. Each file's tests keep their order; a serial run keeps
    pytest's order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    ordered = sorted(files.values(), key=lambda group: -max(_time_limit(i) for i in group))
    items[:] = [i for group in ordered for i in group]
