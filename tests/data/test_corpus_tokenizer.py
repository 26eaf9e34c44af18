"""The embedded corpus and the BPE tokenizer: deterministic, capped, cached."""

from __future__ import annotations

import json
import threading
import time

import pytest

from zeal.data.corpus import EOT, Corpus, file_corpus, stdlib_corpus, stdlib_files
from zeal.data.tokenizer import build_once, load_or_train_tokenizer, tokenizer_sha256, train_tokenizer

pytestmark = pytest.mark.timeout(60)


def test_stdlib_corpus_is_deterministic_and_capped():
    a, b = stdlib_corpus(300_000), stdlib_corpus(300_000)
    assert a.sha256 == b.sha256 and a.names == b.names
    assert 0 < a.num_bytes <= 300_000
    assert all(n.endswith(".py") for n in a.names)
    assert not any(part in ("test", "tests", "site-packages") for n in a.names for part in n.split("/")[:-1])
    bigger = stdlib_corpus(600_000)
    assert bigger.sha256 != a.sha256 and bigger.num_bytes > a.num_bytes


def test_stdlib_files_order_is_stable():
    files = stdlib_files()
    assert len(files) > 100 and files == stdlib_files()


def test_corpus_digest_covers_names_and_text():
    a = Corpus.from_documents(["x"], ["ab"])
    assert Corpus.from_documents(["x"], ["ab"]).sha256 == a.sha256
    assert Corpus.from_documents(["y"], ["ab"]).sha256 != a.sha256
    assert Corpus.from_documents(["x", ""], ["a", "b"]).sha256 != Corpus.from_documents(["x"], ["ab"]).sha256


def test_file_corpus_formats(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("hello world\n")
    assert file_corpus(txt).documents == ("hello world\n",)
    jl = tmp_path / "b.jsonl"
    rows = ["plain", {"text": "t"}, {"prompt": "p", "completion": "c"},
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    jl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert file_corpus(jl).documents == ("plain", "t", "pc", "user: hi\nassistant: yo")
    bad = tmp_path / "c.jsonl"
    bad.write_text('{"text": "ok"}\n{oops\n')
    with pytest.raises(ValueError, match=r"c.jsonl:2: not valid JSON"):
        file_corpus(bad)
    bad.write_text('{"title": "x"}\n')
    with pytest.raises(ValueError, match="'text'"):
        file_corpus(bad)
    with pytest.raises(ValueError, match="is not a file"):
        file_corpus(tmp_path / "missing.txt")


def test_tokenizer_is_deterministic_and_round_trips():
    corpus = stdlib_corpus(200_000)
    a = train_tokenizer(corpus.documents, 512)
    b = train_tokenizer(corpus.documents, 512)
    assert tokenizer_sha256(a) == tokenizer_sha256(b)
    assert a.get_vocab_size() == 512 and a.token_to_id(EOT) == 0
    text = "def f(x):\n    return x ** 2  # ünïcode ✓\n"
    assert a.decode(a.encode(text).ids) == text
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(corpus.documents, 100)


def test_tokenizer_cache_reuses_the_file(tmp_path):
    corpus = Corpus.from_documents(["a"], ["def foo(bar):\n    return bar\n" * 50])
    t1 = load_or_train_tokenizer(corpus, 300, root=tmp_path)
    files = list((tmp_path / "tokenizers").glob("*.json"))
    assert len(files) == 1
    mtime = files[0].stat().st_mtime_ns
    t2 = load_or_train_tokenizer(corpus, 300, root=tmp_path)
    assert files[0].stat().st_mtime_ns == mtime and tokenizer_sha256(t1) == tokenizer_sha256(t2)
    load_or_train_tokenizer(corpus, 320, root=tmp_path)  # other settings → other entry
    assert len(list((tmp_path / "tokenizers").glob("*.json"))) == 2


def test_build_once_waits_for_the_lock_holder(tmp_path):
    target = tmp_path / "x.bin"
    lock = tmp_path / "x.bin.lock"
    lock.write_text("")
    calls = []

    def holder():
        time.sleep(0.5)
        target.write_text("built by holder")
        lock.unlink()

    threading.Thread(target=holder).start()
    build_once(target, lambda tmp: calls.append(tmp))
    assert target.read_text() == "built by holder" and calls == []
    other = tmp_path / "y.bin"
    build_once(other, lambda tmp: tmp.write_text("mine"))
    assert other.read_text() == "mine" and not (tmp_path / "y.bin.lock").exists()


def test_generated_tables_are_left_out_of_the_stdlib_corpus(tmp_path, monkeypatch):
    """Codec tables dominated what the default job's model learnt (its sample printed
    `0x00c8f -> RIGHT ...`): a file whose code lines are mostly literal tables is left out."""
    from zeal.data.corpus import MAX_TABLE_SHARE, table_line_share

    monkeypatch.setenv("ZEAL_CACHE", str(tmp_path / "cache"))
    table = "decoding_table = (\n" + "".join(f"    '\\x{i:02x}'     #  0x{i:02x} -> CHAR {i}\n"
                                             for i in range(64)) + ")\nmap = {\n    0x0080: 0x00c7,  # C\n}\n"
    code = '"""A docstring\nover lines."""\nimport os\n\n\ndef f(x):\n    """Doc."""\n    return os.path.join(x, "a")\n'
    assert table_line_share(table) > 0.9 and table_line_share(code) == 0.0
    assert table_line_share("x = (\n") == 1.0  # does not tokenize: left out
    root = tmp_path / "lib"
    (root / "encodings").mkdir(parents=True)
    (root / "encodings" / "cp999.py").write_text(table)
    (root / "mod.py").write_text(code)
    corpus = stdlib_corpus(10**6, root=root)
    assert corpus.names == ("mod.py",)
    real = stdlib_corpus(4_000_000)
    assert not [n for n in real.names if n.startswith("encodings/cp") or n == "html/entities.py"]
    assert real.num_bytes > 3_900_000  # the cap is still filled, with code
    assert all(table_line_share(d) <= MAX_TABLE_SHARE for d in real.documents[:40])
    assert (tmp_path / "cache" / "corpus").is_dir()  # the shares are memoised in the cache
    assert stdlib_corpus(4_000_000).sha256 == real.sha256
