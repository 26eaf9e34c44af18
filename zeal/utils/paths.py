"""zeal's cache folder: the one place that reads ``$ZEAL_CACHE``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of zeal's caches (tokenizers, token files, converted GGUF models, compiled
    kernels): ``$ZEAL_CACHE``, else ``~/.cache/zeal``. Read at each call, so a test or
    a command may point it elsewhere after import."""
    root = os.environ.get("ZEAL_CACHE") or Path.home() / ".cache" / "zeal"
    return Path(root).expanduser()
