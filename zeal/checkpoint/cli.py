"""``zeal checkpoint export | inspect``: the implementations the command line's ``checkpoint`` command finds."""

from __future__ import annotations

import argparse
import sys

from zeal.checkpoint.export import export_hf, inspect_checkpoint
from zeal.checkpoint.files import CheckpointError


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _failed(command: str, e: CheckpointError) -> int:
    msg = " ".join(str(e).split())
    print(f"zeal checkpoint {command}: error: {msg}", file=sys.stderr)
    return 1


def export(args: argparse.Namespace) -> int:
    """Write a Hugging Face folder from a checkpoint; prints what was written (exit 1,
    one line on stderr, when the checkpoint is unusable)."""
    try:
        s = export_hf(args.checkpoint, args.out, tag=args.tag, dtype=args.dtype,
                      tokenizer=getattr(args, "tokenizer", None), merge_lora=getattr(args, "merge_lora", False))
    except CheckpointError as e:
        return _failed("export", e)
    print(f"exported {s['checkpoint']} -> {s['out']}: {s['tensors']} tensors, {_size(s['bytes'])} "
          f"({s['dtype']}) in {', '.join(s['files'])} + config.json")
    if s["tokenizer"]:
        names = ", ".join(f"{k} {v!r}" for k, v in s["special_tokens"].items()) or "no special tokens"
        print(f"  tokenizer from {s['tokenizer']}: {s['vocab']} tokens, {names}"
              + (", chat template" if s["chat_template"] else ""))
    else:
        print("  no tokenizer found next to the checkpoint: the folder holds weights only "
              "(pass --tokenizer PATH to add one)")
    return 0


def inspect(args: argparse.Namespace) -> int:
    """Print step, world size, stage, tensors and sizes; exit 1 when a checksum fails or
    the checkpoint is unusable (a manifest naming a path outside its folder, say)."""
    try:
        info = inspect_checkpoint(args.checkpoint, tag=args.tag)
    except CheckpointError as e:
        return _failed("inspect", e)
    print(f"checkpoint {info['path']}")
    print(f"  tag {info['tag']} (commit #{info['seq']}), step {info['global_steps']}, world size "
          f"{info['world_size']}, ZeRO stage {info['zero_stage']}")
    if "parameters" in info:
        print(f"  model {info['model_class']}, {info['parameters']:,} parameters, compute {info['compute_dtype']}, "
              f"optimizer {info['optimizer']} ({', '.join(info['optimizer_state']) or 'no state'}), "
              f"{info['skipped_steps']} skipped steps, {info['global_samples']} samples")
        for name, t in info["tensors"].items():
            print(f"    {name:<48} {str(tuple(t['shape'])):<20} {'trainable' if t['trainable'] else 'frozen'}")
        for name, shape in info["buffers"].items():
            print(f"    {name:<48} {str(tuple(shape)):<20} buffer")
    for name, f in info["files"].items():
        status = "ok" if f["ok"] else f"FAILED: {f['error']}"
        print(f"  {name:<28} {_size(f['bytes']):>10}  sha256 {status}")
    print("  checksums verified" if info["verified"] else "  CHECKSUM VERIFICATION FAILED")
    return 0 if info["verified"] else 1
