"""Checkpoints: save, load (any world size, any ZeRO stage), export and inspect.

Everything here goes through the public sharded-state API of the engine
(``engine.sharded_state()`` / ``engine.load_sharded_state(...)``, see
:mod:`zeal.zero.sharded_state`), never through engine internals. Files are
safetensors plus JSON, written to a temporary folder, fsynced and renamed; see
:mod:`zeal.checkpoint.files` (commit, manifest), :mod:`zeal.checkpoint.save` (the
format), :mod:`zeal.checkpoint.reader` (reading any box, formats 1 and 2).
"""

from zeal.checkpoint.export import export_hf, inspect_checkpoint
from zeal.checkpoint.files import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from zeal.checkpoint.load import load
from zeal.checkpoint.save import save

__all__ = ["CheckpointCorruptError", "CheckpointError", "CheckpointMismatchError", "export_hf",
           "inspect_checkpoint", "load", "save"]
