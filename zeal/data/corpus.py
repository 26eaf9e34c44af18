"""Text corpora for training jobs: the embedded one and user files.

The embedded corpus is the Python standard library's own source code: it exists on
every machine that runs zeal, needs no download, and is large enough (tens of MB)
to train a small language model on. Files are read in a fixed order (sorted by a
hash of their relative path, so that the size cap keeps a spread of modules rather
than the alphabetically first ones), test suites are skipped, and the total is
capped, so the same Python version always yields the same corpus. ``Corpus.sha256``
identifies the exact text and keys every cache built from it.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

EOT = "<|endoftext|>"
"""Document separator; also the tokenizer's first special token."""

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


@dataclass(frozen=True)
class Corpus:
    """An ordered list of documents. Invariant: ``sha256`` is the digest of
    ``names`` and ``documents`` together, so equal digests mean equal text."""

    names: tuple[str, ...]
    documents: tuple[str, ...]
    sha256: str

    @property
    def num_bytes(self) -> int:
        return sum(len(d.encode("utf-8")) for d in self.documents)

    @staticmethod
    def from_documents(names: list[str], documents: list[str]) -> Corpus:
        h = hashlib.sha256()
        for name, doc in zip(names, documents, strict=True):
            for part in (name, doc):
                data = part.encode("utf-8")
                h.update(len(data).to_bytes(8, "little"))
                h.update(data)
        return Corpus(tuple(names), tuple(documents), h.hexdigest())


def stdlib_root() -> Path:
    """Folder holding the running interpreter's standard-library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """Every ``*.py`` file of the standard library outside test suites and
    third-party folders, in the corpus order (sorted by SHA-1 of the relative path)."""
    root = Path(root) if root is not None else stdlib_root()
    files = [
        p for p in root.rglob("*.py")
        if not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1]) and p.is_file()
    ]
    return sorted(files, key=lambda p: (hashlib.sha1(p.relative_to(root).as_posix().encode()).hexdigest(),
                                        p.relative_to(root).as_posix()))


def stdlib_corpus(max_bytes: int = 4_000_000, root: Path | None = None) -> Corpus:
    """The embedded corpus: standard-library sources taken in corpus order until
    adding the next file would pass ``max_bytes`` (UTF-8 bytes)."""
    if max_bytes <= 0:
        raise ValueError(f"data.max_bytes must be positive, got {max_bytes}")
    root = Path(root) if root is not None else stdlib_root()
    names: list[str] = []
    docs: list[str] = []
    total = 0
    for path in stdlib_files(root):
        text = path.read_bytes().decode("utf-8", errors="replace")
        size = len(text.encode("utf-8"))
        if total + size > max_bytes:
            continue  # a smaller later file may still fit
        names.append(path.relative_to(root).as_posix())
        docs.append(text)
        total += size
    if not docs:
        raise ValueError(f"no standard-library source found under {root}")
    return Corpus.from_documents(names, docs)


def _jsonl_text(record: object, where: str) -> str:
    if isinstance(record, str):
        return record
    if isinstance(record, dict):
        if isinstance(record.get("text"), str):
            return record["text"]
        if isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
            return record["prompt"] + record["completion"]
        msgs = record.get("messages")
        if isinstance(msgs, list) and all(isinstance(m, dict) and "content" in m for m in msgs):
            return "\n".join(f"{m.get('role', 'user')}: {m['content']}" for m in msgs)
    raise ValueError(f"{where}: expected a string or an object with 'text', 'prompt'+'completion' or 'messages'")


def file_corpus(path: str | Path) -> Corpus:
    """A corpus from a user file: ``.jsonl`` (one document per line: a string, or an
    object with ``text``, ``prompt`` + ``completion`` or chat ``messages``) or any
    other file read as one plain-text document."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data.path {str(path)!r} is not a file")
    raw = path.read_bytes().decode("utf-8", errors="replace")
    if path.suffix == ".jsonl":
        names, docs = [], []
        for i, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not valid JSON ({e.msg})") from None
            names.append(f"{path.name}:{i}")
            docs.append(_jsonl_text(record, f"{path}:{i}"))
    else:
        names, docs = [path.name], [raw]
    if not docs or not any(docs):
        raise ValueError(f"data.path {str(path)!r} holds no text")
    return Corpus.from_documents(names, docs)
