"""KV-cache memory: fixed-size blocks with reference counts, prefix caching, copy-on-write.

The block manager owns *which* block holds *which* tokens; it never touches the
tensors (the model runner does). Invariants (checked by
``tests/inference/test_block_manager.py`` under random workloads):

* ``ref_count[b]`` equals the number of block tables that contain ``b``;
* a block is in the free pool iff its reference count is 0; a block shared by
  two tables has a count >= 2;
* only *full* blocks whose KV has been computed carry a prefix hash; a free
  block with a hash stays reusable (a prefix-cache hit) until it is handed out
  fresh, oldest freed first, and only when no free block without a hash is left.

Free blocks without cached content are handed out lowest id first, so that the
blocks in use stay packed at the front of the cache: decode attention then reads
long runs of blocks in place instead of gathering them
(:func:`zeal.inference.attention.plan_decodes`).

Prefix hashes are chained: block ``i``'s key is ``(hash of block i-1, its
tokens)``, so a hit means the whole prefix matches, not just one block.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from zeal.inference.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


class BlockManager:
    """Allocator over ``num_blocks`` blocks of ``block_size`` token slots."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks {num_blocks} and block_size {block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.free_plain: list[int] = list(range(num_blocks))  # heap: free blocks without a hash
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # free blocks with a hash, LRU order
        self.block_hash: dict[int, int] = {}  # block -> hash (full, computed blocks only)
        self.cached: dict[int, int] = {}  # hash -> block
        self.seq_hashes: dict[int, list[int]] = {}  # seq_id -> chained hashes of its full blocks
        self.num_prefix_hits = 0  # blocks reused from the cache (tokens not recomputed)
        self.num_prefix_queries = 0
        self.epoch = 0  # bumped by reset_prefix_cache()
        self.seq_epoch: dict[int, int] = {}  # seq_id -> epoch its blocks were allocated in

    # ------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_plain) + len(self.free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def is_free(self, b: int) -> bool:
        return b in self.free_cached or b in self.free_plain

    def _chain(self, tokens: list[int], upto_blocks: int, known: list[int], salt: int = 0) -> list[int]:
        """Chained hashes of the first ``upto_blocks`` blocks; ``salt`` (a LoRA adapter's load
        id, 0 for the base model) seeds the chain, so equal tokens under different weights
        never share a block."""
        hashes = list(known[:upto_blocks])
        bs = self.block_size
        seed = hash(("lora", salt)) if salt else 0
        for i in range(len(hashes), upto_blocks):
            prev = hashes[-1] if hashes else seed
            hashes.append(hash((prev, tuple(tokens[i * bs : (i + 1) * bs]))))
        return hashes

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the sequence's prefix. At least one token is left
        to compute, so that the pass that finishes the prompt has logits to sample. None for a
        sequence whose prompt log-probs are still to score: they need every position's logits,
        which a cached block does not keep (its blocks are still registered for later requests)."""
        if not self.enable_prefix_caching or seq.needs_prompt_logits:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = self._chain(seq.tokens, max_blocks, self.seq_hashes.get(seq.seq_id, []), seq.lora_id)
        hits = []
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether every known token of ``seq`` can get a slot now."""
        need = blocks_for(seq.num_tokens, self.block_size)
        hits = self._prefix_hits(seq)
        # hits on blocks already in use cost nothing; hits on free cached blocks still leave the pool
        in_use = sum(1 for b in hits if self.ref_count[b] > 0)
        return need - in_use <= self.num_free_blocks

    def can_append(self, seq: Sequence) -> bool:
        """Whether the next token of a decoding ``seq`` has a slot (a new or copied block if needed)."""
        idx = seq.num_computed // self.block_size
        if idx >= len(seq.block_table) or self.ref_count[seq.block_table[idx]] > 1:
            return self.num_free_blocks >= 1
        return True

    # ------------------------------------------------------------ actions
    def _take_fresh(self) -> int:
        if self.free_plain:
            b = heapq.heappop(self.free_plain)
        else:
            b, _ = self.free_cached.popitem(last=False)  # evict the least recently freed
            h = self.block_hash.pop(b)
            if self.cached.get(h) == b:
                del self.cached[h]
        self.ref_count[b] = 1
        return b

    def _take(self, b: int) -> None:
        if self.ref_count[b] == 0:
            del self.free_cached[b]  # only blocks with a hash are found again
        self.ref_count[b] += 1

    def allocate(self, seq: Sequence) -> int:
        """Give ``seq`` blocks for all its known tokens, reusing cached prefix blocks.
        Sets ``seq.block_table`` and ``seq.num_computed``; returns the tokens reused."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks")
        if not self.can_allocate(seq):
            raise RuntimeError(f"not enough free KV blocks for sequence {seq.seq_id}")
        hits = self._prefix_hits(seq)
        self.num_prefix_queries += (seq.num_tokens - 1) // self.block_size
        self.num_prefix_hits += len(hits)
        for b in hits:
            self._take(b)
        table = list(hits)
        while len(table) < blocks_for(seq.num_tokens, self.block_size):
            table.append(self._take_fresh())
        seq.block_table = table
        seq.num_computed = len(hits) * self.block_size
        self.seq_hashes[seq.seq_id] = [self.block_hash[b] for b in hits]
        self.seq_epoch[seq.seq_id] = self.epoch
        return seq.num_computed

    def append_slot(self, seq: Sequence) -> tuple[int, int] | None:
        """Make the slot of token ``seq.num_computed`` writable: add a block when the last
        one is full, copy the block when it is shared (copy-on-write). Returns the
        ``(src, dst)`` copy the model runner must do before the pass, if any."""
        idx = seq.num_computed // self.block_size
        if idx == len(seq.block_table):
            seq.block_table.append(self._take_fresh())
            return None
        if idx > len(seq.block_table):
            raise RuntimeError(f"sequence {seq.seq_id} is missing blocks")
        old = seq.block_table[idx]
        if self.ref_count[old] == 1:
            return None
        new = self._take_fresh()
        self._release(old)
        seq.block_table[idx] = new
        return old, new

    def append_draft_slots(self, seq: Sequence, n: int, reserve: int = 0) -> int:
        """Slots for up to ``n`` draft tokens after position ``seq.num_computed`` (whose slot
        :meth:`append_slot` made writable), taking fresh blocks while more than ``reserve``
        are free. Returns how many drafts got a slot."""
        bs = self.block_size
        for i in range(n):
            idx = (seq.num_computed + 1 + i) // bs
            if idx == len(seq.block_table):
                if self.num_free_blocks <= max(0, reserve):
                    return i
                seq.block_table.append(self._take_fresh())
        return n

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Fresh blocks at the end of ``seq``'s table until it has slots for ``num_tokens``
        tokens; False (and nothing taken) when too few blocks are free."""
        need = blocks_for(num_tokens, self.block_size) - len(seq.block_table)
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            seq.block_table.append(self._take_fresh())
        return True

    def trim(self, seq: Sequence) -> None:
        """Free the blocks past those ``seq``'s known tokens need (rejected drafts' KV)."""
        keep = blocks_for(seq.num_tokens, self.block_size)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent`` (a reference each); written blocks
        are copied later by :meth:`append_slot`."""
        for b in parent.block_table:
            self._take(b)
        child.block_table = list(parent.block_table)
        child.num_computed = parent.num_computed
        self.seq_hashes[child.seq_id] = list(self.seq_hashes.get(parent.seq_id, []))
        self.seq_epoch[child.seq_id] = self.seq_epoch.get(parent.seq_id, self.epoch)

    def commit(self, seq: Sequence) -> None:
        """Register the prefix hashes of blocks that became full and computed."""
        if not self.enable_prefix_caching or self.seq_epoch.get(seq.seq_id, self.epoch) != self.epoch:
            return
        full = seq.num_computed // self.block_size
        known = self.seq_hashes.setdefault(seq.seq_id, [])
        if full <= len(known):
            return
        hashes = self._chain(seq.tokens, full, known, seq.lora_id)
        for i in range(len(known), full):
            b, h = seq.block_table[i], hashes[i]
            if h not in self.cached and b not in self.block_hash:
                self.cached[h] = b
                self.block_hash[b] = h
        self.seq_hashes[seq.seq_id] = hashes

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (new weights make them wrong): free hashed blocks
        become plain free blocks, blocks in use lose their hash, and sequences already
        running never register their blocks (their KV mixes both weights)."""
        for b in self.free_cached:
            heapq.heappush(self.free_plain, b)
        self.free_cached.clear()
        self.block_hash.clear()
        self.cached.clear()
        self.seq_hashes.clear()
        self.epoch += 1

    def _release(self, b: int) -> None:
        self.ref_count[b] -= 1
        if self.ref_count[b] < 0:
            raise RuntimeError(f"block {b} freed twice")
        if self.ref_count[b] == 0:
            if b in self.block_hash:
                self.free_cached[b] = None  # most recently freed: evicted last
            else:
                heapq.heappush(self.free_plain, b)

    def free_seq(self, seq: Sequence) -> None:
        """Drop the sequence's references (tail first, so shared prefixes are evicted last)."""
        for b in reversed(seq.block_table):
            self._release(b)
        seq.block_table = []
        seq.num_computed = 0
        self.seq_hashes.pop(seq.seq_id, None)
        self.seq_epoch.pop(seq.seq_id, None)
