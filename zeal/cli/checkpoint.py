"""`zeal checkpoint export | inspect`: front end of the checkpoint tools.

The work is done by the checkpoint package (``zeal/checkpoint/``); this file only
parses arguments and finds the implementation, so that the command reports clearly
when that package is absent from an installation. Looked up in order:
``zeal.checkpoint.cli.export(args)`` / ``.inspect(args)``, then
``export_hf(checkpoint, out, tag=, dtype=, tokenizer=)`` / ``inspect_checkpoint(checkpoint, tag=)``
in ``zeal.checkpoint``.
"""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Callable
from typing import Any

_CANDIDATES = {
    "export": [("zeal.checkpoint.cli", "export", True), ("zeal.checkpoint", "export_hf", False)],
    "inspect": [("zeal.checkpoint.cli", "inspect", True), ("zeal.checkpoint", "inspect_checkpoint", False)],
}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``zeal checkpoint`` and its subcommands."""
    p = subparsers.add_parser("checkpoint", help="inspect a checkpoint or export it to a Hugging Face folder",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                              allow_abbrev=False)
    sub = p.add_subparsers(dest="checkpoint_command", metavar="SUBCOMMAND", required=True)
    e = sub.add_parser("export", help="write a Hugging Face folder (config.json, model.safetensors, tokenizer)",
                       allow_abbrev=False)
    e.add_argument("checkpoint", help="checkpoint folder (run folder, checkpoints folder or tag)")
    e.add_argument("out", help="output folder")
    e.add_argument("--tag", default=None, help="checkpoint tag (default: the latest)")
    e.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="stored dtype")
    e.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="tokenizer.json or a folder holding one (default: the run folder's tokenizer.json)")
    e.add_argument("--merge-lora", action="store_true",
                   help="merge the LoRA adapters of a LoRA training checkpoint into their base weights")
    i = sub.add_parser("inspect", help="print step, world size, stage and tensors; verify checksums",
                       allow_abbrev=False)
    i.add_argument("checkpoint", help="checkpoint folder")
    i.add_argument("--tag", default=None, help="checkpoint tag (default: the latest)")
    return p


def find_impl(command: str) -> tuple[Callable[..., Any], bool]:
    """(function, takes_args_namespace) implementing ``zeal checkpoint COMMAND``."""
    for module_name, attr, takes_args in _CANDIDATES[command]:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name == module_name:
                continue
            raise
        fn = getattr(module, attr, None)
        if callable(fn):
            return fn, takes_args
    raise ValueError(f"'zeal checkpoint {command}' is not available in this installation "
                     "(the checkpoint tools in zeal/checkpoint/ are missing)")


def run(args: argparse.Namespace) -> int:
    """Dispatch to the checkpoint module."""
    fn, takes_args = find_impl(args.checkpoint_command)
    if takes_args:
        return int(fn(args) or 0)
    if args.checkpoint_command == "export":
        result = fn(args.checkpoint, args.out, tag=args.tag, dtype=args.dtype, tokenizer=args.tokenizer)
    else:
        result = fn(args.checkpoint, tag=args.tag)
    if isinstance(result, dict):
        print(json.dumps(result, indent=2, default=str))
    elif result is not None:
        print(result)
    return 0
