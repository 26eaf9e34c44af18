"""`zeal compress`: N:M sparsity and/or int8/int4 weights for a Hugging Face model folder.

  zeal compress --sparsity 2:4 --method wanda --out smol-24
  zeal compress --sparsity 2:4 --method admm --bits 4 --out smol-24-w4     # ~3.5 min on 2 CPU cores
  zeal compress --sparsity 2:4 --method admm --bits 4 --steps 16 --out smol-24-w4   # + 16 QAT steps

No --model: the embedded SmolLM2-135M-Instruct. No --data: Python's documentation
topics (pydoc_data), every fifth topic held out for the perplexity printed before and
after, every fifth other one the calibration text (Wanda's activation norms, ADMM's Gram matrices), the rest
the fine-tuning text (--steps); a --data FILE is split the same way by paragraphs. ADMM prints a
line per block with the time so far and an estimate of the time left; a perplexity more than 3x
the dense one ends in a warning naming a better method. The output folder loads in `zeal serve DIR` and, in the compressed-tensors
format, in vLLM and llm-compressor (int4/int8 weights packed with their scales; the
2:4 zeros are stored as values, recorded in the config when the weights are quantized).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``zeal compress``."""
    p = subparsers.add_parser("compress", help="N:M sparsity (magnitude, Wanda, ADMM) and int8/int4 weights",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                              allow_abbrev=False)
    p.add_argument("--model", default=None, metavar="PATH", help="HF folder (default: the embedded SmolLM2)")
    p.add_argument("--sparsity", default=None, metavar="N:M", help="keep N of every M weights along the input "
                   "dimension of every linear but the head (for example 2:4); omit for quantization only")
    p.add_argument("--method", choices=("admm", "magnitude", "wanda"), default="magnitude", help="how to prune")
    p.add_argument("--admm-objective", choices=("reconstruction", "loss"), default="reconstruction",
                   help="admm: each linear's output error on the calibration text (no steps spent; all --steps "
                   "fine-tune) or the training loss (NxMTransformer: the first quarter of --steps)")
    p.add_argument("--admm-iters", type=int, default=20, help="admm on the reconstruction: ADMM iterations per "
                   "linear (each a solve and an N:M projection; the time of the prune is about proportional)")
    p.add_argument("--bits", type=int, choices=(8, 4), default=None, help="weight bits (QAT with --steps, else PTQ)")
    p.add_argument("--group-size", type=int, default=None, help="weights per scale (default: per output channel)")
    p.add_argument("--steps", type=int, default=0, help="optimizer steps on the fine-tuning text (ADMM on the "
                   "loss: the first quarter ADMM, the rest masked fine-tuning); 0 = one-shot")
    p.add_argument("--lr", type=float, default=1e-5, help="fine-tuning learning rate (AdamW)")
    p.add_argument("--loss", choices=("ce", "kd"), default="ce", help="fine-tuning loss: next-token cross-entropy "
                   "or distillation from the uncompressed model (KL on the logits)")
    p.add_argument("--data", default=None, metavar="FILE", help="calibration text (default: pydoc_data topics)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per block")
    p.add_argument("--calib-blocks", type=int, default=32, help="calibration blocks (Wanda norms); fine-tuning "
                   "takes up to max(this, 2 x --steps) blocks of its own text")
    p.add_argument("--eval-blocks", type=int, default=16, help="held-out blocks for perplexity")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder")
    p.add_argument("--format", choices=("compressed-tensors", "dense"), default="compressed-tensors",
                   help="compressed-tensors (packed int weights) or dense (the quantized values as floats)")
    return p


def _check(args: argparse.Namespace) -> tuple[int | None, int]:
    """The flags' own checks (no file read): ``(N, M)`` of the sparsity, N None when off."""
    from zeal.compression.nm import parse_pattern

    if args.sparsity is None and args.bits is None:
        raise ValueError("give --sparsity N:M, --bits 8|4, or both")
    if args.sparsity is None and args.method != "magnitude":
        raise ValueError(f"--method {args.method} prunes: it needs --sparsity N:M (--bits alone only quantizes)")
    for flag in ("steps", "seq_len", "calib_blocks", "eval_blocks", "admm_iters"):
        if getattr(args, flag) < (0 if flag == "steps" else 1 if flag == "admm_iters" else 2):
            raise ValueError(f"--{flag.replace('_', '-')} is out of range: {getattr(args, flag)}")
    if args.group_size is not None and (args.group_size < 1 or args.bits is None):
        raise ValueError(f"--group-size {args.group_size}: " + ("must be >= 1" if args.group_size < 1 else
                                                                 "applies to quantized weights: give --bits"))
    if not math.isfinite(args.lr) or args.lr <= 0:
        raise ValueError(f"--lr must be a positive finite number, got {args.lr}")
    if args.data is not None and not Path(args.data).is_file():
        raise ValueError(f"--data {args.data!r} is not a file")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(f"--out {args.out!r} is a file, not a folder")
    if args.sparsity is None:
        return None, 4
    return parse_pattern(args.sparsity)


def _check_dims(src: Path, group_size: int | None, n: int | None, m: int) -> None:
    """The model's linear input sizes (from ``config.json``, before any weight is read)
    fit the group size and M; a config without the Llama keys is left to the load."""
    try:
        cfg = json.loads((src / "config.json").read_text())
        hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
        heads = int(cfg["num_attention_heads"])
        attn = heads * int(cfg.get("head_dim") or hidden // heads)
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return
    checks = [(group_size, "--group-size", "weights per scale"), (m if n else None, "--sparsity", "M")]
    for size, flag, what in checks:
        bad = [d for d in sorted({hidden, inter, attn}) if size is not None and d % size]
        if bad:
            raise ValueError(f"{flag}: {what} {size} does not divide the linear input size {bad[0]} of {src} "
                             f"(input sizes {sorted({hidden, inter, attn})})")


def run(args: argparse.Namespace) -> int:
    """Check the flags, load, compress, report perplexity, write the folder."""
    n, m = _check(args)  # before any import of torch or read of a file
    import torch

    from zeal.compression.calibration import blocks, split_three
    from zeal.compression.pipeline import CompressJob, compress_model
    from zeal.inference.llm import load_model_and_tokenizer, resolve_model_path

    src = resolve_model_path(args.model)
    _check_dims(src, args.group_size, n, m)
    model, tok, _ = load_model_and_tokenizer(src, torch.float32)
    if tok is None:
        raise ValueError(f"--model {str(src)!r}: no tokenizer.json to read the calibration text with")
    if type(model).__name__ != "Llama":
        raise ValueError(f"--model {str(src)!r}: zeal compress writes Llama-family folders, not "
                         f"{type(model).__name__}")
    job = CompressJob(n=n, m=m, method=args.method, bits=args.bits, group_size=args.group_size, steps=args.steps,
                      lr=args.lr, loss=args.loss, admm_objective=args.admm_objective,
                      admm_iters=args.admm_iters)
    calib_text, train_text, eval_text = split_three(args.data)
    calib = blocks(tok.encode(calib_text, add_special_tokens=False), args.seq_len, args.calib_blocks)
    train = blocks(tok.encode(train_text, add_special_tokens=False), args.seq_len,
                   max(args.calib_blocks, job.batch * args.steps))
    evals = blocks(tok.encode(eval_text, add_special_tokens=False), args.seq_len, args.eval_blocks)
    print(f"model {src}; calibration {calib.shape[0]}x{args.seq_len} tokens, fine-tuning {train.shape[0]}x"
          f"{args.seq_len}, evaluation {evals.shape[0]}x{args.seq_len}")
    report = compress_model(model, calib, evals, job, train=train, log=lambda s: print(s, flush=True))
    write_folder(model, src, Path(args.out), report.targets, job, args.format)
    print(json.dumps({"ppl_before": round(report.ppl_before, 4), "ppl_after": round(report.ppl_after, 4),
                      "seconds": round(report.seconds, 1), "out": args.out}))
    warning = blowup_warning(job, report.ppl_before, report.ppl_after)
    if warning:
        print(warning, flush=True)
    return 0


BLOWUP = 3.0
"""Perplexity after / before above which ``zeal compress`` warns and names a better method."""


def blowup_warning(job, before: float, after: float) -> str | None:
    """One warning line when compression multiplied the held-out perplexity by more than
    ``BLOWUP``, naming what measured better on SmolLM2 (bench/compression/README.md:
    Wanda and ADMM beat magnitude 3x at 2:4; masked fine-tuning recovers most of the rest;
    int8 or a small group size for int4); None otherwise."""
    if after <= BLOWUP * before:  # a NaN perplexity compares False: it warns
        return None
    if job.n is not None and job.method == "magnitude":
        better = "--method wanda (seconds) or --method admm (minutes), both with --steps 32"
    elif job.n is not None and job.steps == 0:
        better = "--steps 32 of masked fine-tuning (--loss kd distils from the dense model)"
    elif job.n is not None:
        better = f"a milder pattern than {job.n}:{job.m} (e.g. 4:8) or more --steps with --loss kd"
    elif job.bits == 4 and job.group_size is None:
        better = "--group-size 32 (a scale per 32 weights) or --bits 8"
    else:
        better = "--bits 8 or more --steps of quantization-aware training"
    return (f"warning: perplexity went from {before:.2f} to {after:.2f} ({after / before:.1f}x, over {BLOWUP:g}x): "
            f"try {better}")


def write_folder(model, src: Path, out: Path, targets: list[str], job, fmt: str) -> None:
    """The compressed model as a HF folder with the source's tokenizer files."""
    import torch

    from zeal.compression.export import export_compressed
    from zeal.compression.modules import QATLinear, QuantSpec, linear_targets, ptq_
    from zeal.models.hf import save_hf_folder

    if job.bits and fmt == "dense":
        ptq_(linear_targets(model, None, job.exclude), QuantSpec(job.bits, job.group_size))  # idempotent after PTQ; what QAT's forward used
    for lin in model.modules():
        if isinstance(lin, QATLinear):
            lin.active = False
    save_hf_folder(model, out)
    with torch.no_grad():
        if fmt == "compressed-tensors":
            quant = {t: (job.bits, job.group_size) for t in targets} if job.bits else {}
            sparse = {t: (job.n, job.m) for t in targets} if job.n else None
            export_compressed(out, quant, sparse, ignore=["lm_head"])
    src_cfg = json.loads((src / "config.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    for k in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if k in src_cfg and k not in cfg:
            cfg[k] = src_cfg[k]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (src / f).is_file():
            shutil.copy(src / f, out / f)
