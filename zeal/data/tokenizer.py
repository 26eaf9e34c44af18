"""A byte-level BPE tokenizer trained on a corpus with the `tokenizers` library, cached.

The tokenizer is a plain ``tokenizers.Tokenizer`` (GPT-2 style: byte-level
pre-tokenization, so every string round-trips). It is trained once per
(corpus digest, settings) and stored as JSON under the zeal cache folder
(``$ZEAL_CACHE`` or ``~/.cache/zeal``). Several processes may ask for the
same file at once: one builds it under a lock file, the others wait, and the
file appears atomically (written aside, then renamed).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from zeal.data.corpus import EOT, Corpus
from zeal.utils.paths import cache_dir

TOKENIZER_FORMAT = 1
"""Bumped when the training recipe changes, so old cache entries are not reused."""


def build_once(path: Path, build: Callable[[Path], None], timeout_s: float = 900.0) -> Path:
    """Make sure ``path`` exists, calling ``build(tmp_path)`` in at most one process.

    ``build`` writes the content to the temporary path it is given; it is then
    renamed into place, so readers never see a half-written file. Processes that
    lose the race for ``path.lock`` poll until the file appears; a lock older than
    ``timeout_s`` is considered abandoned and taken over.
    """
    path = Path(path)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.with_name(path.name + ".lock")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if path.exists():
                return path
            try:
                stale = time.time() - lock.stat().st_mtime > timeout_s
            except FileNotFoundError:
                continue
            if stale:
                lock.unlink(missing_ok=True)
                continue
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {path} (lock {lock})") from None
            time.sleep(0.2)
            continue
        os.close(fd)
        try:
            if not path.exists():
                tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
                build(tmp)
                os.replace(tmp, path)
            return path
        finally:
            lock.unlink(missing_ok=True)


def train_tokenizer(documents: list[str] | tuple[str, ...], vocab_size: int = 4096) -> Tokenizer:
    """Train a byte-level BPE tokenizer with ``<|endoftext|>`` as token 0."""
    if vocab_size < 257 + 1:
        raise ValueError(f"data.vocab_size must be at least 258 (256 bytes + specials), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(iter(documents), trainer=trainer, length=len(documents))
    return tok


def tokenizer_key(corpus: Corpus, vocab_size: int) -> str:
    """Cache key for the tokenizer trained on ``corpus`` with these settings."""
    settings = json.dumps({"corpus": corpus.sha256, "vocab_size": vocab_size, "format": TOKENIZER_FORMAT},
                          sort_keys=True)
    return hashlib.sha256(settings.encode()).hexdigest()[:20]


def tokenizer_sha256(tok: Tokenizer) -> str:
    """Digest of the tokenizer's full JSON (vocabulary, merges, settings)."""
    return hashlib.sha256(tok.to_str().encode()).hexdigest()


def load_or_train_tokenizer(corpus: Corpus, vocab_size: int = 4096, root: Path | None = None,
                            say: Callable[[str], None] | None = None) -> Tokenizer:
    """The cached tokenizer for ``corpus``, trained and stored on first use (``say`` is
    told before the training starts)."""
    root = Path(root) if root is not None else cache_dir()
    path = root / "tokenizers" / f"bpe-{tokenizer_key(corpus, vocab_size)}.json"
    if say is not None and not path.is_file():
        say(f"training a {vocab_size}-token BPE tokenizer on the corpus (first run only; cached in {path.parent})")
    build_once(path, lambda tmp: train_tokenizer(corpus.documents, vocab_size).save(str(tmp)))
    return Tokenizer.from_file(str(path))
