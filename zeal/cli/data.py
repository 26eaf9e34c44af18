"""`zeal data analyze CORPUS --metric voc|seqlen --workers N`: the data analyzer of curriculum learning.

CORPUS is ``stdlib`` (the embedded standard-library corpus, as ``zeal train`` uses it)
or a ``.txt`` / ``.jsonl`` file. It is tokenized and cut into the training blocks of a
job with the same ``--seq-len``, ``--vocab-size``, ``--max-bytes``,
``--heldout-fraction`` and ``--seed`` (the job's ``data`` section); sample ``i`` is the
``i``-th training block, as the curriculum sampler of ``zeal train`` numbers them. The
metric of every block is computed by ``--workers`` processes (map-reduce; the result does
not depend on N), the sorted index files are written to ``--out`` (numpy ``.npy``), a
histogram is printed and, when matplotlib is installed, ``<metric>_histogram.png`` written.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``zeal data`` and its ``analyze`` subcommand."""
    p = subparsers.add_parser("data", help="analyze a corpus for curriculum learning", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    sub = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND", required=True)
    a = sub.add_parser("analyze", help="per-sample difficulty metric, sorted index files, histogram",
                       allow_abbrev=False)
    a.add_argument("corpus", help="'stdlib' or a .txt / .jsonl file")
    a.add_argument("--metric", default="voc", choices=["voc", "seqlen"], help="difficulty metric (default voc)")
    a.add_argument("--workers", type=int, default=1, help="worker processes of the map (default 1)")
    a.add_argument("--out", default="data_analysis", help="output folder (default ./data_analysis)")
    a.add_argument("--seq-len", type=int, default=128, help="tokens per block (data.seq_len)")
    a.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary (data.vocab_size)")
    a.add_argument("--max-bytes", type=int, default=4_000_000,
                   help="cap on the corpus: the stdlib corpus is cut to it, a larger file is refused "
                        "(data.max_bytes; a job trains on all of a file)")
    a.add_argument("--heldout-fraction", type=float, default=0.05, help="held-out share (data.heldout_fraction)")
    a.add_argument("--seed", type=int, default=1234, help="split seed (data.seed)")
    a.add_argument("--bins", type=int, default=20, help="histogram bins (default 20)")
    return p


def training_blocks(corpus: str, seq_len: int, vocab_size: int, max_bytes: int, heldout_fraction: float,
                    seed: int):
    """The training blocks ``(n, seq_len)`` of a job over ``corpus`` (and its tokenizer)."""
    import numpy as np

    from zeal.data.corpus import file_corpus, stdlib_corpus
    from zeal.data.text_dataset import TokenBlocks, load_or_encode
    from zeal.data.tokenizer import load_or_train_tokenizer

    text = stdlib_corpus(max_bytes) if corpus == "stdlib" else file_corpus(corpus)
    tokenizer = load_or_train_tokenizer(text, vocab_size)
    blocks = TokenBlocks.split(load_or_encode(text, tokenizer), seq_len, heldout_fraction, seed)
    starts = blocks.train_index.astype(np.int64)[:, None] * seq_len
    rows = blocks.ids[starts + np.arange(seq_len)]
    return rows, tokenizer


def check_args(args: argparse.Namespace) -> None:
    """Every flag checked before the corpus is read: the job's own limits (its ``data``
    section), and a file corpus no larger than ``--max-bytes``."""
    from pydantic import ValidationError

    from zeal.config.job import DataSection

    if args.corpus != "stdlib" and not Path(args.corpus).is_file():
        raise ValueError(f"CORPUS {args.corpus!r} is neither 'stdlib' nor a file")
    for flag in ("workers", "bins"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    try:
        DataSection(max_bytes=args.max_bytes, vocab_size=args.vocab_size, seq_len=args.seq_len,
                    heldout_fraction=args.heldout_fraction, seed=args.seed)
    except ValidationError as e:
        raise ValueError("; ".join(f"--{str(err['loc'][0]).replace('_', '-')}: {err['msg']} (got {err['input']!r})"
                                   for err in e.errors())) from None
    if args.corpus != "stdlib" and (size := Path(args.corpus).stat().st_size) > args.max_bytes:
        raise ValueError(f"CORPUS {args.corpus!r} is {size} bytes, above --max-bytes {args.max_bytes}: "
                         f"give --max-bytes {size} to analyze all of it (a job trains on the whole file)")


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from zeal.data.analyzer import MetricIndex, analyze, format_histogram, write_histogram_png

    check_args(args)
    rows, tokenizer = training_blocks(args.corpus, args.seq_len, args.vocab_size, args.max_bytes,
                                      args.heldout_fraction, args.seed)
    index: MetricIndex = analyze(rows, args.metric, args.workers, vocab_size=tokenizer.get_vocab_size())
    paths = index.save(args.out, args.metric)
    v = index.sample_to_metric
    print(f"{args.metric} over {len(v)} training blocks of {args.seq_len} tokens ({args.workers} worker(s)): "
          f"min {v.min()}, median {int(np.median(v))}, max {v.max()}")
    print(format_histogram(v, args.bins))
    png = write_histogram_png(v, Path(args.out) / f"{args.metric}_histogram.png", args.metric)
    print("wrote " + ", ".join(str(p) for p in paths) + (f", {png}" if png else
                                                          " (no PNG: matplotlib is not installed)"))
    return 0
