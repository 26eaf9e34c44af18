"""Token blocks, the held-out split and the pure batch sampler."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zeal.data.corpus import Corpus
from zeal.data.text_dataset import BlockSampler, TokenBlocks, encode_corpus, load_or_encode
from zeal.data.tokenizer import train_tokenizer

pytestmark = pytest.mark.timeout(60)


def test_split_is_deterministic_disjoint_and_complete():
    ids = np.arange(10_000, dtype=np.uint16)
    a = TokenBlocks.split(ids, 16, 0.1, seed=3)
    b = TokenBlocks.split(ids, 16, 0.1, seed=3)
    assert np.array_equal(a.train_index, b.train_index) and np.array_equal(a.heldout_index, b.heldout_index)
    n = 10_000 // 16
    assert len(a.heldout_index) == round(n * 0.1)
    assert sorted(np.concatenate([a.train_index, a.heldout_index]).tolist()) == list(range(n))
    assert not np.array_equal(TokenBlocks.split(ids, 16, 0.1, seed=4).heldout_index, a.heldout_index)
    blk = a.block(a.train_index[0])
    assert blk.dtype.is_floating_point is False and blk.tolist() == list(range(a.train_index[0] * 16,
                                                                                 a.train_index[0] * 16 + 16))


def test_split_errors_name_the_setting():
    with pytest.raises(ValueError, match="seq_len"):
        TokenBlocks.split(np.arange(100), 1)
    with pytest.raises(ValueError, match="too few"):
        TokenBlocks.split(np.arange(10), 8, 0.5)


def test_heldout_batches_are_equal_across_ranks():
    blocks = TokenBlocks.split(np.arange(64 * 40, dtype=np.uint16), 64, 0.5, seed=0)  # 20 held-out
    per_rank = [blocks.heldout_batches(3, None, r, 2) for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) == 3
    seen = [tuple(x[:, 0].tolist()) for batches in per_rank for x in batches]
    flat = [v for t in seen for v in t]
    assert len(flat) == len(set(flat)) == 18
    assert len(blocks.heldout_batches(3, 2, 0, 2)) == 2
    small = TokenBlocks.split(np.arange(64 * 10, dtype=np.uint16), 64, 0.3, seed=0)  # 3 held-out
    assert [b.shape[0] for b in small.heldout_batches(8, None, 1, 2)] == [1]


@settings(max_examples=30, deadline=None)
@given(n=st.integers(5, 60), micro=st.integers(1, 4), accum=st.integers(1, 3), world=st.integers(1, 4))
def test_sampler_walks_each_epoch_once(n, micro, accum, world):
    s = BlockSampler(n, micro, accum, world, seed=7)
    per_step = micro * accum * world
    steps = -(-n // per_step) + 1
    stream = [int(i) for step in range(steps) for m in range(accum) for r in range(world)
              for i in s.indices(step, m, r)]
    assert sorted(stream[:n]) == list(range(n))  # the first epoch is a permutation
    again = BlockSampler(n, micro, accum, world, seed=7)
    assert again.indices(steps - 1, accum - 1, world - 1).tolist() == s.indices(steps - 1, accum - 1, world - 1).tolist()


def test_encode_cache(tmp_path):
    corpus = Corpus.from_documents(["a", "b"], ["x = 1\n" * 30, "y = 2\n" * 30])
    tok = train_tokenizer(corpus.documents, 300)
    direct = encode_corpus(corpus, tok)
    assert direct[-1] == tok.token_to_id("<|endoftext|>")
    cached = load_or_encode(corpus, tok, root=tmp_path)
    assert np.array_equal(cached, direct)
    assert np.array_equal(load_or_encode(corpus, tok, root=tmp_path), direct)
    assert len(list((tmp_path / "tokens").glob("*.bin"))) == 1
