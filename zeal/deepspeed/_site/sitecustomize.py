"""Turns zeal's DeepSpeed switch on when ``ZEAL_DEEPSPEED=1`` (this folder first on
``PYTHONPATH``; see :mod:`zeal.deepspeed.switch`), then runs the ``sitecustomize``
this one shadows, if any."""

import importlib.util
import os
import sys

if os.environ.get("ZEAL_DEEPSPEED", "") not in ("", "0"):
    from zeal.deepspeed.switch import install

    install()


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        path = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("_zeal_shadowed_sitecustomize", path)
            if spec and spec.loader:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


_chain()
