"""DeepSpeed's ``save_checkpoint`` semantics over zeal's checkpoints: saving to a tag that
exists replaces it (Hugging Face's Trainer saves ``global_stepN`` twice under ZeRO-3 when
``stage3_gather_16bit_weights_on_model_save`` is off), where zeal's own save refuses.

The old folder is moved aside (``.<tag>.replaced``), the new one is written and committed
by zeal's atomic save, then the old one is deleted; a failed save puts it back."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from zeal.dist.agree import first_error
from zeal.zero.sharded_state import state_comm


def save_replacing(engine: Any, save_dir: str, tag: str, client_state: dict) -> str:
    """``engine.save_checkpoint(save_dir, tag, client_state)`` (zeal's engine), replacing a
    committed ``save_dir/tag``; every rank calls it."""
    comm = state_comm(engine)
    root = Path(save_dir)
    old, aside = root / tag, root / f".{tag}.replaced"
    moved, err = False, None
    if engine.mesh.rank == 0 and old.is_dir():
        try:
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(old, aside)
            moved = True
        except OSError as e:
            err = f"cannot replace {old}: {e}"
    err = first_error(comm, err)  # also the barrier: no rank writes before the old folder is aside
    if err:
        raise OSError(err)
    try:
        path = engine.save_checkpoint(save_dir, tag=tag, client_state=client_state)
    except BaseException:
        if moved and not old.exists():
            os.rename(aside, old)
        raise
    if moved:
        shutil.rmtree(aside, ignore_errors=True)
    return path
