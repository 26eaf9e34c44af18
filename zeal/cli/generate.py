"""`zeal generate --checkpoint DIR "prompt"`: sample from a model trained by `zeal train`.

DIR is a run folder (``runs/default``), its ``checkpoints`` folder, or one tag
folder inside it. The job's ``config.json`` and ``tokenizer.json`` (written by
`zeal train` into the run folder) say how to rebuild the model; the weights come
from the checkpoint through a single-process engine (checkpoints load on any
world size and ZeRO stage).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``zeal generate``."""
    p = subparsers.add_parser("generate", help="sample text from a trained checkpoint", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("prompt", nargs="?", default=None, help="text to continue (default: the job's sample prompt)")
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="run folder, checkpoints folder or tag folder")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: the latest)")
    p.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate (default 100)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest tokens (0 = all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    return p


def locate(path: str | Path, tag: str | None) -> tuple[Path, Path, str | None]:
    """(run folder, checkpoints folder, tag) for a path given by the user."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"--checkpoint {str(p)!r} does not exist")
    for run in (p, p.parent, p.parent.parent):
        if (run / "config.json").is_file() and (run / "tokenizer.json").is_file():
            break
    else:
        raise ValueError(f"--checkpoint {str(p)!r}: no config.json + tokenizer.json from 'zeal train' in it "
                         "or its parents")
    ckpts = run / "checkpoints"
    if p.resolve() not in (run.resolve(), ckpts.resolve()) and p.parent.resolve() == ckpts.resolve():
        tag = tag or p.name  # a tag folder was given
    if not ckpts.is_dir():
        raise ValueError(f"--checkpoint {str(p)!r}: no checkpoints folder in {run}")
    return run, ckpts, tag


def run(args: argparse.Namespace) -> int:
    """Load the checkpoint on one process and print a sample."""
    from tokenizers import Tokenizer

    import zeal
    from zeal.config.job import read_spec
    from zeal.train.job import build_model, sample

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not 0 <= args.seed < 2**32:
        raise ValueError(f"--seed must be in [0, 2**32), got {args.seed}")
    if not args.temperature >= 0 or args.temperature == float("inf") or args.top_k < 0:
        raise ValueError(f"--temperature must be a finite number >= 0 and --top-k >= 0, got {args.temperature} "
                         f"and {args.top_k}")
    run_dir, ckpts, tag = locate(args.checkpoint, args.tag)
    spec = read_spec(run_dir / "config.json")
    zeal.apply_process_settings(spec.process)  # as the job ran
    tokenizer = Tokenizer.from_file(str(run_dir / "tokenizer.json"))
    model = build_model(spec, tokenizer.get_vocab_size())
    engine_cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0},
                  "optimizer": spec.engine.get("optimizer", {"type": "AdamW", "params": {}})}
    engine = zeal.initialize(model, engine_cfg)
    try:
        engine.load_checkpoint(str(ckpts), tag=tag, load_optimizer_states=False, load_lr_scheduler_states=False)
    except TypeError:  # an engine without the selective-load keywords
        engine.load_checkpoint(str(ckpts), tag=tag)
    prompt = args.prompt if args.prompt is not None else spec.job.sample_prompt
    print(sample(engine, tokenizer, prompt, args.max_new_tokens, args.temperature, args.top_k,
                 spec.data.seq_len, args.seed))
    return 0
