"""The KV cache in blocks: which block holds which tokens, who reads it, and which are kept for reuse.

No torch here. Each worker's KV memory is `num_blocks` fixed-size blocks of
`block_size` positions (vLLM's paged cache, NxDI's block KV layout); a
sequence holds a block table, one block per `block_size` of its tokens, so it
holds memory in proportion to its length, not to the longest request.

Prefix caching: a full block is named by a chained hash of its token ids (the
block's own and every token before it, through the previous block's hash)
salted with whatever else changes the KV (the model, its dtype). Once a block's
KV is complete it is published under that hash; a later sequence whose prompt
starts with the same tokens takes the published blocks instead of computing or
receiving them again. Blocks are reference-counted: a published block whose
last reader finished stays cached, least recently used first out, until its
memory is needed. A block a sequence still reads is never freed or reused,
whatever happens to the other sequences reading it (a cancel, an expired lease,
a failed step): each one only drops its own reference.

Block 0 is never handed out: block tables are padded with it (a row reading
past its own length reads block 0, and masks it out), as vLLM's null block.
"""

from __future__ import annotations

import collections
import hashlib
from array import array
from dataclasses import dataclass

NULL_BLOCK = 0
DEFAULT_BLOCK_SIZE = 16  # vLLM's default


class NoFreeBlocks(Exception):
    """Not enough blocks, even after evicting every unreferenced cached one."""


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def block_hashes(token_ids: list[int], block_size: int, salt: str, limit: int | None = None) -> list[bytes]:
    """The chained hash of each full block of token_ids (at most `limit` blocks)."""
    count = len(token_ids) // block_size if limit is None else min(limit, len(token_ids) // block_size)
    previous = hashlib.blake2b(salt.encode(), digest_size=16).digest()
    hashes = []
    for i in range(count):
        block = array("q", token_ids[i * block_size : (i + 1) * block_size]).tobytes()
        previous = hashlib.blake2b(previous + block, digest_size=16).digest()
        hashes.append(previous)
    return hashes


def cache_salt(model_name: str, dtype: str, kv_cache_dtype: str = "") -> str:
    """What besides the tokens changes a block's KV (a future adapter joins it here)."""
    return f"{model_name}|{dtype}" + (f"|kv {kv_cache_dtype}" if kv_cache_dtype else "")


@dataclass
class BlockStats:
    queried_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of those, found cached
    evictions: int = 0  # cached blocks dropped to make room


class BlockPool:
    """Blocks 1..num_blocks-1 (0 is the null block): free, in use (referenced) or cached (published, unreferenced)."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool = True):
        if num_blocks < 2:
            raise ValueError("a block pool needs at least 2 blocks (block 0 is the null block)")
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        self.num_blocks, self.block_size, self.caching = num_blocks, block_size, caching
        self._free = collections.deque(range(1, num_blocks))
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # unreferenced published blocks, LRU first
        self.stats = BlockStats()

    # -- queries ---------------------------------------------------------
    @property
    def usable(self) -> int:
        return self.num_blocks - 1

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def cached_blocks(self) -> int:
        """Published blocks no sequence reads: kept for reuse, evicted when memory is needed."""
        return len(self._cached)

    @property
    def used_blocks(self) -> int:
        return self.usable - self.free_blocks - self.cached_blocks

    def references(self, block: int) -> int:
        return self._refs[block]

    def available(self) -> int:
        """Blocks an allocation can take now (free ones, then evicted cached ones)."""
        return len(self._free) + len(self._cached)

    def cached_prefix(self, hashes: list[bytes]) -> list[int]:
        """The published blocks holding the longest prefix of `hashes`."""
        blocks = []
        if self.caching:
            for h in hashes:
                block = self._by_hash.get(h)
                if block is None:
                    break
                blocks.append(block)
        return blocks

    def can_allocate(self, hashes: list[bytes], total_blocks: int) -> bool:
        hit = self.cached_prefix(hashes)
        # A hit block waiting in the cache is both matched and counted as available: take it out once.
        idle_hits = sum(1 for b in hit if self._refs[b] == 0)
        return total_blocks - len(hit) <= self.available() - idle_hits

    # -- mutations -------------------------------------------------------
    def allocate(self, hashes: list[bytes], total_blocks: int) -> tuple[list[int], int]:
        """A block table of total_blocks: the cached blocks of the longest published prefix of
        `hashes` (shared, referenced), then fresh blocks. Returns (table, cached blocks)."""
        if not self.can_allocate(hashes, total_blocks):
            raise NoFreeBlocks(f"{total_blocks} blocks asked, {self.available()} available")
        hit = self.cached_prefix(hashes)[:total_blocks]
        for block in hit:
            self._take(block)
        fresh = [self._take_fresh() for _ in range(total_blocks - len(hit))]
        self.stats.queried_tokens += len(hashes) * self.block_size
        self.stats.hit_tokens += len(hit) * self.block_size
        return hit + fresh, len(hit)

    def publish(self, table: list[int], hashes: list[bytes]) -> None:
        """Names the table's first len(hashes) blocks by their hashes, once their KV is complete.
        A hash already held by another block (two prompts computed at once) keeps that one."""
        if not self.caching:
            return
        for block, h in zip(table, hashes):
            if self._hash_of.get(block) == h or h in self._by_hash:
                continue
            if block in self._hash_of:  # the block is already named otherwise: not this prefix's
                break
            self._hash_of[block] = h
            self._by_hash[h] = block

    def release(self, table: list[int]) -> None:
        """Drops one reference to each block of the table; a block no one reads is cached if
        published (most recently used last), else free."""
        for block in reversed(table):  # a sequence's later blocks are evicted before its earlier ones
            if block == NULL_BLOCK:
                continue
            if self._refs[block] <= 0:
                raise AssertionError(f"block {block} released more often than taken")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._cached[block] = None
                else:
                    self._free.append(block)

    def _take(self, block: int) -> None:
        if self._refs[block] == 0:
            self._cached.pop(block, None)
        self._refs[block] += 1

    def _take_fresh(self) -> int:
        if not self._free:
            block, _ = self._cached.popitem(last=False)
            del self._by_hash[self._hash_of.pop(block)]
            self.stats.evictions += 1
            self._free.append(block)
        block = self._free.popleft()
        self._refs[block] = 1
        return block

    # -- invariants ------------------------------------------------------
    def check_integrity(self) -> None:
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free), "a block is free twice"
        assert not free & cached, "a block is both free and cached"
        assert NULL_BLOCK not in free | cached and self._refs[NULL_BLOCK] == 0, "the null block was handed out"
        for block in range(1, self.num_blocks):
            referenced = self._refs[block] > 0
            assert referenced + (block in free) + (block in cached) == 1, f"block {block}: referenced, free and cached disagree"
            assert block not in cached or block in self._hash_of, f"cached block {block} has no hash"
            assert block not in free or block not in self._hash_of, f"free block {block} still has a hash"
        assert all(self._by_hash[h] == b for b, h in self._hash_of.items()), "hash maps disagree"
