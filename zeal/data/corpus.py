"""Text corpora for training jobs: the embedded one and user files.

The embedded corpus is the Python standard library's own source code: it exists on
every machine that runs zeal, needs no download, and is large enough (tens of MB)
to train a small language model on. Files are read in a fixed order (sorted by a
hash of their relative path, so that the size cap keeps a spread of modules rather
than the alphabetically first ones), test suites are skipped, and the total is
capped, so the same Python version always yields the same corpus. ``Corpus.sha256``
identifies the exact text and keys every cache built from it.

Generated data tables are left out, so that what a small model learns is Python a
person would recognise rather than codec tables (``encodings/cp*.py`` alone are 13 %
of the unfiltered 4 MB). The rule (:func:`table_line_share`): a *table line* is a
line whose tokens are all literals (strings, numbers) and separators ``, : ( ) [ ] { }``
with at least one literal, e.g. ``0x0080: 0x00c7,  # LATIN CAPITAL LETTER C`` or
``'\\x00'  #  0x00 -> NULL``; a lone triple-quoted string (a docstring) is not one.
A file is dropped when more than ``MAX_TABLE_SHARE`` (30 %) of its code lines are
table lines, or when it does not tokenize. On CPython 3.11 this drops the codec
tables, ``pydoc_data/topics.py``, ``html/entities.py``, ``locale.py``'s alias table,
``stringprep.py``, ``_sysconfigdata*.py`` and a few small constant modules.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sysconfig
import tokenize
from dataclasses import dataclass
from pathlib import Path

EOT = "<|endoftext|>"
"""Document separator; also the tokenizer's first special token."""

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}

MAX_TABLE_SHARE = 0.3
"""A standard-library file whose share of table lines passes this is left out of the corpus."""

_LITERALS = {tokenize.STRING, tokenize.NUMBER}
_NOT_CODE = {tokenize.NEWLINE, tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT,
             tokenize.ENDMARKER}
_SEPARATORS = {",", ":", "(", ")", "[", "]", "{", "}"}


def table_line_share(text: str) -> float:
    """Share of the code lines of Python source ``text`` that are table lines: every
    token a literal or a separator, at least one literal, and not a lone docstring.
    Comments and blank lines are not code lines. Source that does not tokenize gives 1.0."""
    lines: dict[int, list[tokenize.TokenInfo]] = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type not in _NOT_CODE:
                lines.setdefault(tok.start[0], []).append(tok)
    except (tokenize.TokenError, SyntaxError):
        return 1.0
    if not lines:
        return 0.0
    tables = 0
    for toks in lines.values():
        if len(toks) == 1 and toks[0].type == tokenize.STRING and \
                toks[0].string.lstrip("rbuRBU").startswith(('"""', "'''")):
            continue  # a docstring
        if any(t.type in _LITERALS for t in toks) and all(
                t.type in _LITERALS or (t.type == tokenize.OP and t.string in _SEPARATORS) for t in toks):
            tables += 1
    return tables / len(lines)


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
    adding the next file would pass ``max_bytes`` (UTF-8 bytes), generated tables
    left out (a file with more than ``MAX_TABLE_SHARE`` table lines, see the module
    docstring)."""
    if max_bytes <= 0:
        raise ValueError(f"data.max_bytes must be positive, got {max_bytes}")
    root = Path(root) if root is not None else stdlib_root()
    names: list[str] = []
    docs: list[str] = []
    total = 0
    shares = _TableShares()
    for path in stdlib_files(root):
        text = path.read_bytes().decode("utf-8", errors="replace")
        size = len(text.encode("utf-8"))
        if total + size > max_bytes:
            continue  # a smaller later file may still fit
        if shares.of(text) > MAX_TABLE_SHARE:
            continue  # generated data (codec tables, entity maps): not Python a person writes
        names.append(path.relative_to(root).as_posix())
        docs.append(text)
        total += size
    if not docs:
        raise ValueError(f"no standard-library source found under {root}")
    shares.save()
    return Corpus.from_documents(names, docs)


class _TableShares:
    """:func:`table_line_share` memoised by the SHA-1 of the text, kept in one JSON
    file of the zeal cache (tokenizing 4 MB takes seconds; a lookup, milliseconds).
    Written through a temporary file and a rename, so concurrent ranks never read
    half a file; an unreadable file is recomputed."""

    def __init__(self) -> None:
        from zeal.utils.paths import cache_dir

        self.path = cache_dir() / "corpus" / "table-line-share-v1.json"
        try:
            self.known: dict[str, float] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.known = {}
        self.changed = False

    def of(self, text: str) -> float:
        key = hashlib.sha1(text.encode("utf-8", errors="replace")).hexdigest()
        if key not in self.known:
            self.known[key] = table_line_share(text)
            self.changed = True
        return self.known[key]

    def save(self) -> None:
        if not self.changed:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.known))
            os.replace(tmp, self.path)
        except OSError:
            pass  # a read-only cache only costs the recomputation next time


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
