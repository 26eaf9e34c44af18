"""``deepspeed.utils.zero_to_fp32`` on zeal's checkpoints: the whole model in fp32 from a
checkpoint any ZeRO stage and world size wrote, read tensor by tensor from its shards.

``checkpoint_dir`` is the folder holding ``latest`` and the tag folders (what
``engine.save_checkpoint(save_dir)`` was given, e.g. a Hugging Face ``checkpoint-N``
folder), or a tag folder itself."""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | os.PathLike, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> OrderedDict:
    """The model's state dict (parameters from the fp32 masters, buffers as saved) of
    ``tag`` (default: the one ``latest`` names). ``exclude_frozen_parameters`` and
    ``lazy_mode`` are refused (zeal's checkpoints do not mark frozen parameters; tensors are
    read one at a time already)."""
    from zeal.checkpoint import files as cf
    from zeal.checkpoint.export import find_checkpoint, open_verified
    from zeal.deepspeed.refusals import Refused

    if lazy_mode or exclude_frozen_parameters:
        raise Refused("zero_to_fp32 lazy_mode / exclude_frozen_parameters", "read the whole state, then drop the "
                      "frozen names yourself")
    _, meta, shards = open_verified(find_checkpoint(Path(checkpoint_dir), tag))
    state: OrderedDict = OrderedDict()
    for name, entry in meta["params"].items():
        state[name] = shards.full("param", name, entry["shape"], torch.float32)
    for name, entry in meta.get("buffers", {}).items():
        state[name] = shards.whole(f"buffer/{name}", dtype=cf.DTYPE_BY_NAME[entry["dtype"]])
    return state


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike,
                                               max_shard_size: str = "5GB", safe_serialization: bool = True,
                                               tag: str | None = None, exclude_frozen_parameters: bool = False) -> None:
    """Write the fp32 state dict to ``output_dir/model.safetensors`` (safetensors only:
    zeal never writes pickles; ``safe_serialization=False`` is refused)."""
    from safetensors.torch import save_file

    from zeal.deepspeed.refusals import Refused

    if not safe_serialization:
        raise Refused("convert_zero_checkpoint_to_fp32_state_dict(safe_serialization=False)",
                      "zeal writes safetensors only")
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    os.makedirs(output_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(output_dir, "model.safetensors"))


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str | os.PathLike,
                                         tag: str | None = None) -> Any:
    """Load the fp32 state dict into ``model`` (moved to the CPU, as DeepSpeed's) and return it."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model
