"""Token blocks for language-model training: encode once, cut, split, sample.

A corpus is encoded into one stream of token ids (documents joined by the
end-of-text token) and cached as raw little-endian integers under the zeal cache
folder. The stream is cut into fixed-length blocks; a seeded permutation puts a
fixed fraction of blocks in a held-out set. Training batches come from
``BlockSampler``, a pure function of (step, micro-step, rank): resuming at step
``s`` replays exactly the batches an uninterrupted run would have seen, with no
sampler state to save.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from zeal.data.corpus import EOT, Corpus
from zeal.data.tokenizer import build_once, tokenizer_sha256
from zeal.utils.paths import cache_dir


def encode_corpus(corpus: Corpus, tokenizer: Tokenizer) -> np.ndarray:
    """All documents as one id stream, each document followed by ``<|endoftext|>``."""
    eot = tokenizer.token_to_id(EOT)
    ids: list[int] = []
    for enc in tokenizer.encode_batch(list(corpus.documents), add_special_tokens=False):
        ids.extend(enc.ids)
        if eot is not None:
            ids.append(eot)
    dtype = np.uint16 if tokenizer.get_vocab_size() <= 2**16 else np.uint32
    return np.asarray(ids, dtype=dtype)


def load_or_encode(corpus: Corpus, tokenizer: Tokenizer, root: Path | None = None,
                   say: Callable[[str], None] | None = None) -> np.ndarray:
    """``encode_corpus`` through a cache keyed by the corpus and tokenizer digests (``say``
    is told before an encoding starts)."""
    root = Path(root) if root is not None else cache_dir()
    dtype = np.dtype(np.uint16 if tokenizer.get_vocab_size() <= 2**16 else np.uint32).newbyteorder("<")
    key = hashlib.sha256(f"{corpus.sha256}:{tokenizer_sha256(tokenizer)}:{dtype.str}".encode()).hexdigest()[:20]
    path = root / "tokens" / f"{key}.bin"
    if say is not None and not path.is_file():
        say(f"encoding the corpus ({corpus.num_bytes / 1e6:.1f} MB; first run only; cached in {path.parent})")
    build_once(path, lambda tmp: encode_corpus(corpus, tokenizer).astype(dtype).tofile(tmp))
    return np.fromfile(path, dtype=dtype)


@dataclass(frozen=True)
class TokenBlocks:
    """Non-overlapping blocks of ``block_size`` tokens over an id stream, with a
    deterministic train / held-out split. Invariant: the two index sets are
    disjoint, sorted and cover every block."""

    ids: np.ndarray
    block_size: int
    train_index: np.ndarray
    heldout_index: np.ndarray

    @staticmethod
    def split(ids: np.ndarray, block_size: int, heldout_fraction: float = 0.05, seed: int = 1234,
              min_heldout: int = 1) -> TokenBlocks:
        """Cut ``ids`` into blocks and hold out ``heldout_fraction`` of them (at least
        ``min_heldout``), chosen by a permutation seeded with ``seed``."""
        if block_size < 2:
            raise ValueError(f"data.seq_len must be at least 2, got {block_size}")
        if not 0.0 <= heldout_fraction < 1.0:
            raise ValueError(f"data.heldout_fraction must be in [0, 1), got {heldout_fraction}")
        n = len(ids) // block_size
        n_held = max(min_heldout, round(n * heldout_fraction)) if heldout_fraction > 0 else 0
        if n - n_held < 1:
            raise ValueError(f"the data holds {len(ids)} tokens: too few for blocks of {block_size} "
                             f"with {n_held} held out")
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy()
        return TokenBlocks(ids, block_size, np.sort(perm[n_held:]), np.sort(perm[:n_held]))

    def block(self, i: int) -> torch.Tensor:
        """Block ``i`` (a global block index) as int64 ids, shape ``(block_size,)``."""
        start = int(i) * self.block_size
        return torch.from_numpy(self.ids[start : start + self.block_size].astype(np.int64))

    def batch(self, indices: np.ndarray | list[int]) -> torch.Tensor:
        """Blocks stacked into ``(len(indices), block_size)``."""
        return torch.stack([self.block(i) for i in indices])

    def heldout_batches(self, batch_size: int, max_batches: int | None, rank: int = 0,
                        world_size: int = 1) -> list[torch.Tensor]:
        """This rank's share of the held-out evaluation batches. Every rank gets the
        same number of equally sized batches (so collective forward passes line up);
        a trailing remainder that cannot be shared evenly is dropped."""
        per_round = batch_size * world_size
        n_rounds = len(self.heldout_index) // per_round
        if n_rounds == 0:  # too few blocks for full batches: one smaller batch each
            per_rank = len(self.heldout_index) // world_size
            if per_rank == 0:
                raise ValueError(f"{len(self.heldout_index)} held-out blocks cannot be shared by {world_size} ranks")
            return [self.batch(self.heldout_index[rank * per_rank : (rank + 1) * per_rank])]
        if max_batches is not None:
            n_rounds = min(n_rounds, max_batches)
        out = []
        for r in range(n_rounds):
            start = r * per_round + rank * batch_size
            out.append(self.batch(self.heldout_index[start : start + batch_size]))
        return out


@dataclass(frozen=True)
class BlockSampler:
    """Which training blocks a rank reads at a given (step, micro-step).

    The global sample stream walks seeded permutations of the training blocks, one
    per epoch; step ``s``, micro-step ``m`` consumes ``world_size * micro_batch``
    consecutive samples of it, rank ``r`` taking the ``r``-th slice. Pure: no state
    to checkpoint."""

    num_blocks: int
    micro_batch: int
    grad_accum: int
    world_size: int
    seed: int = 0

    def indices(self, step: int, micro: int, rank: int) -> np.ndarray:
        """Positions (into the training index) of this rank's micro-batch."""
        first = ((step * self.grad_accum + micro) * self.world_size + rank) * self.micro_batch
        out = np.empty(self.micro_batch, dtype=np.int64)
        for j in range(self.micro_batch):
            epoch, pos = divmod(first + j, self.num_blocks)
            out[j] = self._permutation(epoch)[pos]
        return out

    def _permutation(self, epoch: int) -> np.ndarray:
        return _epoch_permutation(self.num_blocks, self.seed, epoch)


_PERM_CACHE: dict[tuple[int, int, int], np.ndarray] = {}


def _epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    key = (n, seed, epoch)
    if key not in _PERM_CACHE:
        if len(_PERM_CACHE) > 4:
            _PERM_CACHE.clear()
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        _PERM_CACHE[key] = torch.randperm(n, generator=g).numpy()
    return _PERM_CACHE[key]
