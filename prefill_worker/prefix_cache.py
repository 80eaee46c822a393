"""The prefill worker's prefix cache: prompts' KV kept in blocks, so a prompt that starts
with tokens computed before runs only the rest (vLLM's automatic prefix caching).

The KV is `num_blocks` blocks of `block_size` positions per layer, keys and values
[num_blocks, kv_heads, block_size, head_dim] in the model's dtype on its device; which
block holds what is `disagg.engine.kv_blocks.BlockPool`'s (chained hashes of the
blocks' tokens salted with the model and dtype, reference counts, an LRU of cached
blocks). For a prompt of L tokens:

1. `begin`: the hashes of its first (L - 1) // block_size full blocks are looked up
   (at least one token is always computed: the first token's logits come from it),
   and a block table is allocated for its L // block_size full blocks, the cached
   ones first. No room (a prompt of more blocks than the pool holds): no table, and
   the prompt prefills whole, uncached; a request never fails for cache space.
2. `gather`: the hit blocks' K/V, per layer [kv_heads, P, head_dim], P = hits *
   block_size: what the backend's prefill attends over instead of computing.
3. `store`: once the prefill has run, the new full blocks' K/V go into their fresh
   blocks, and `publish` names them, so later prompts find them.
4. `release`: always, success or not; the blocks stay cached (LRU). A prefill that
   fails releases its table unpublished: a half-written block is never found.

An 8-bit KV cache (`--kv-cache-dtype`) keeps the prefill's codes and their scales per block
and head, as the decode worker does: a hit hands back the codes it stored (sent on as they
are), and the prefill attends over the values they stand for.

Every call runs on the thread that runs the model (the worker's device executor):
one prompt at a time, so no lock, and while one prompt holds its table no other
prompt allocates.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from disagg.engine.backends.base import ModelInfo, PrefixKv
from disagg.engine.kv_blocks import BlockPool, block_hashes, cache_salt
from disagg.engine.quantization import kv_cache
from disagg.engine.quantization.kv_cache import QuantizedBlocks

log = logging.getLogger(__name__)


@dataclass
class CachePlan:
    """One prompt's use of the cache, from `begin` to `release`."""

    table: list[int]  # a block per full block of the prompt: the hits, then fresh ones
    hits: int  # leading blocks of the table found cached
    hashes: list[bytes]  # every full block's hash (published once their KV is stored)
    block_size: int

    @property
    def prefix_len(self) -> int:
        """Tokens the cache holds: the prefill computes the prompt from here on."""
        return self.hits * self.block_size


class PrefixCache:
    def __init__(self, info: ModelInfo, dtype: torch.dtype, device, num_blocks: int, block_size: int):
        self.info, self.block_size = info, block_size
        self.pool = BlockPool(num_blocks, block_size)
        self.salt = cache_salt(info.name, info.dtype, info.kv_cache_dtype)
        shape = (num_blocks, info.kv_heads, block_size, info.head_dim)
        stored = kv_cache.code_dtype(info.kv_cache_dtype) if info.kv_quantized else dtype
        # torch.empty: pages are taken as blocks are first written, not at start-up.
        self.keys = [torch.empty(shape, dtype=stored, device=device) for _ in range(info.num_layers)]
        self.values = [torch.empty(shape, dtype=stored, device=device) for _ in range(info.num_layers)]
        if info.kv_quantized:
            if info.kv_block_size != block_size:
                raise ValueError(f"prefix cache blocks of {block_size} positions for KV scaled per {info.kv_block_size}")
            self.key_blocks = [QuantizedBlocks(codes, torch.empty(num_blocks, info.kv_heads, device=device)) for codes in self.keys]
            self.value_blocks = [QuantizedBlocks(codes, torch.empty(num_blocks, info.kv_heads, device=device)) for codes in self.values]

    @staticmethod
    def block_bytes(info: ModelInfo, dtype: torch.dtype, block_size: int) -> int:
        return info.kv_block_bytes(torch.empty(0, dtype=dtype).element_size(), block_size)

    @classmethod
    def sized(cls, info: ModelInfo, device, gib: float, block_size: int) -> PrefixCache | None:
        """A cache of `gib` GiB in the model's dtype (block 0, the pool's null block, included),
        or None (logged) where that holds fewer than 2 blocks."""
        dtype = getattr(torch, info.dtype)
        per_block = cls.block_bytes(info, dtype, block_size)
        num_blocks = int(gib * 2**30) // per_block
        if num_blocks < 2:
            log.info("prefix caching off: --prefix-cache-gib %g holds %d blocks of %d tokens (%d bytes each), fewer than 2",
                     gib, num_blocks, block_size, per_block)
            return None
        cache = cls(info, dtype, device, num_blocks, block_size)
        log.info("prefix cache: %d blocks of %d tokens (%.1f MiB, %d tokens)",
                 num_blocks - 1, block_size, num_blocks * per_block / 2**20, (num_blocks - 1) * block_size)
        return cache

    def begin(self, token_ids: list[int]) -> CachePlan | None:
        """The prompt's table (its cached prefix first), or None where the pool has no room for it."""
        length, size = len(token_ids), self.block_size
        hashes = block_hashes(token_ids, size, self.salt)  # every full block: a prompt of k * size tokens computes its last block too
        lookup = hashes[: (length - 1) // size]  # but never takes it from the cache: its last token must run
        if not self.pool.can_allocate(lookup, len(hashes)):
            return None
        table, hits = self.pool.allocate(lookup, len(hashes))
        return CachePlan(table, hits, hashes, size)

    def gather(self, plan: CachePlan) -> PrefixKv | None:
        """Per layer (keys, values) [kv_heads, P, head_dim] of the hit blocks (copied out), or None without hits."""
        if not plan.hits:
            return None
        if self.info.kv_quantized:  # codes and scales as stored: sent on as they are
            table = plan.table[: plan.hits]
            return [(k.read(table, 0, plan.prefix_len), v.read(table, 0, plan.prefix_len)) for k, v in zip(self.key_blocks, self.value_blocks)]
        blocks = torch.tensor(plan.table[: plan.hits], dtype=torch.long, device=self.keys[0].device)
        heads, head_dim = self.info.kv_heads, self.info.head_dim

        def span(pool: torch.Tensor) -> torch.Tensor:
            picked = pool.index_select(0, blocks)  # [hits, kv_heads, block_size, head_dim]
            out = torch.empty((heads, plan.prefix_len, head_dim), dtype=pool.dtype, device=pool.device)
            out.view(heads, plan.hits, self.block_size, head_dim).copy_(picked.transpose(0, 1))
            return out

        return [(span(keys), span(values)) for keys, values in zip(self.keys, self.values)]

    def store(self, plan: CachePlan, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copies the new full blocks' K/V into their fresh blocks; layers: per layer the K/V of
        the tokens the prefill computed, [kv_heads, L - P, head_dim] (P = plan.prefix_len)."""
        fresh = len(plan.table) - plan.hits
        if not fresh:
            return
        tokens = fresh * self.block_size
        if self.info.kv_quantized:
            for (keys, values), key_blocks, value_blocks in zip(layers, self.key_blocks, self.value_blocks):
                key_blocks.write(plan.table[plan.hits :], 0, keys[:, :tokens])
                value_blocks.write(plan.table[plan.hits :], 0, values[:, :tokens])
            return
        blocks = torch.tensor(plan.table[plan.hits :], dtype=torch.long, device=self.keys[0].device)
        for pools, new in ((self.keys, [k for k, _ in layers]), (self.values, [v for _, v in layers])):
            for pool, tensor in zip(pools, new):
                # [kv_heads, fresh * block_size, head_dim] -> [fresh, kv_heads, block_size, head_dim]
                source = tensor[:, :tokens].unflatten(1, (fresh, self.block_size)).transpose(0, 1)
                pool.index_copy_(0, blocks, source.to(pool.device, pool.dtype))

    def publish(self, plan: CachePlan) -> None:
        self.pool.publish(plan.table, plan.hashes)

    def release(self, plan: CachePlan) -> None:
        self.pool.release(plan.table)
