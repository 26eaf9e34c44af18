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
