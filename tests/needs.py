"""``pytestmark = needs("peft", "transformers")``: skip a test module when an optional package
is missing, found without importing it. ``pytest.importorskip`` at a module's top imports the
package while every test worker collects the suite (peft: ~2 s of CPU per worker, compressed-
tensors ~1 s); the tests that use the package import it themselves."""

from __future__ import annotations

import importlib.util

import pytest


def needs(*modules: str) -> pytest.MarkDecorator:
    """A skip mark naming the first of ``modules`` that is not installed (none missing: no skip)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"{', '.join(missing)} not installed")
