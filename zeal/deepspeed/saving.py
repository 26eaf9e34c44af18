"""DeepSpeed's ``save_checkpoint`` semantics over zeal's checkpoints: saving to a tag that
exists replaces it (Hugging Face's Trainer saves ``global_stepN`` twice under ZeRO-3 when
``stage3_gather_16bit_weights_on_model_save`` is off), where zeal's own save refuses.

The old folder is moved aside (``.<tag>.replaced``), the new one is written and committed
by zeal's atomic save, then the old one is deleted; a failed save puts it back.

``load_checkpoint`` returns ``(path, client_state)`` (``(None, None)`` when there is no
checkpoint) and, as DeepSpeed's, does not touch the random generators: a script that
resumes draws the dropout masks and data it would draw under DeepSpeed."""

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


def load_keeping_rng(engine: Any, load_dir: str, tag: Any, load_optimizer_states: bool,
                     load_lr_scheduler_states: bool, load_module_only: bool) -> tuple[str | None, dict | None]:
    """DeepSpeed's ``load_checkpoint`` over zeal's engine: the tag (default: the latest),
    ``(None, None)`` without a checkpoint, the Python / NumPy / torch generators unchanged
    (zeal's own load restores the saved ones; DeepSpeed saves none)."""
    from zeal.checkpoint.extra_state import rng_state, set_rng_state
    from zeal.checkpoint.files import CheckpointError, resolve_tags

    try:
        tags = resolve_tags(Path(load_dir), None if tag is None else str(tag))
    except (CheckpointError, FileNotFoundError, ValueError):  # no folder, no committed tag
        tags = []
    if tag is None and not tags:
        return None, None
    keep = rng_state()
    client = engine.load_checkpoint(load_dir, tag=None if tag is None else str(tag),
                                    load_optimizer_states=load_optimizer_states,
                                    load_lr_scheduler_states=load_lr_scheduler_states,
                                    load_module_only=load_module_only)
    set_rng_state(keep)
    return os.path.join(load_dir, tags[0] if tags else str(tag)), client


def save_16bit(engine: Any, save_dir: str, save_filename: str, exclude_frozen_parameters: bool) -> bool:
    """Write the whole model's state dict (zeal's ``engine.module_state_dict()``) in the
    compute dtype (fp32 when training in fp32) to ``save_dir/save_filename`` from rank 0 — a
    ``.safetensors`` name writes safetensors, any other ``torch.save`` (as DeepSpeed's
    ``save_16bit_model``). Every rank calls it (at stage 3 the parameters are gathered)."""
    import torch

    state = engine.module_state_dict()
    if exclude_frozen_parameters:
        frozen = {n for n, q in engine.module.named_parameters() if not q.requires_grad}
        state = {k: v for k, v in state.items() if k not in frozen}
    state = {k: v.to(engine.compute_dtype) if v.is_floating_point() else v for k, v in state.items()}
    if engine.mesh.rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        path = os.path.join(save_dir, save_filename)
        if save_filename.endswith(".safetensors"):
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in state.items()}, path)
        else:
            torch.save(state, path)
    return True
