"""Example budgets per tier (see tests/conftest.py): ``@budget(ci=20, long=400)`` runs a
property test twice over, as ``[ci]`` with 20 examples in the default tier and as
``[long]`` with 400 (marked ``fuzz``) in the long tier. The test takes a ``max_examples``
argument and hands it to its ``@settings``."""

from __future__ import annotations

import pytest


def budget(ci: int, long: int):
    """``pytest.mark.parametrize`` of ``max_examples`` over the two tiers."""
    if not 0 < ci <= long:
        raise ValueError(f"budget: need 0 < ci <= long, got ci={ci}, long={long}")
    return pytest.mark.parametrize("max_examples", [pytest.param(ci, id="ci"),
                                                    pytest.param(long, id="long", marks=pytest.mark.fuzz)])
