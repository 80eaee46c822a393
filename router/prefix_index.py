"""Cache-aware routing: where a prompt's prefix is most likely cached, weighed against load.

The workers keep a prefix cache of KV blocks (disagg/engine/kv_blocks.py): a
prompt whose leading blocks a worker already holds costs it only the rest. The
router asks no worker what it holds; it keeps an index of its own decisions:
per worker, a bounded LRU set of the block hashes of the prompts it sent there.
A request's overlap with a worker is the number of its leading block hashes in
that worker's set, i.e. how many of its tokens the worker probably still has.

The index only estimates. It never sees what a worker evicted, what another
router sent it, or a restart the poller missed; it hashes with a salt of its
own ("router"), so its names are not the workers'. None of that can make an
answer wrong: a worker computes (or is sent) every block it lacks, so a stale
entry costs one cache miss and nothing else. To keep misses few, a worker's set
is forgotten when the pool marks it unavailable (a failed call, a health check
that fails or says NOT_SERVING: a restart passes through one of these unless it
is quicker than one poll, since WorkerLoad carries no start time) and when
discovery removes it.

Each set is bounded (PREFIX_INDEX_TOKENS of prompt per worker, in blocks): about
what one worker's KV cache holds (a decode worker's default 4 GiB holds about
180,000 tokens of a SmolLM-135M-sized model in bfloat16), so the index neither
remembers much that the worker must have evicted nor forgets much that it still
has; 16,384 hashes of 16 bytes cost ~2 MB of router memory per worker.

Choosing (choose_by_overlap): a hit of h blocks saves h * block_size tokens of
prefill compute (or of KV transfer and decode memory); each request of load
beyond the least-loaded candidate costs LOAD_PENALTY_BLOCKS of that. A worker
at capacity is never chosen for a hit: a decode worker without a free slot is
not a candidate at all, and a prefill worker more than PREFILL_QUEUE_SLACK
prefills behind the least-loaded one is passed over, so a popular prefix
cannot pile a queue on one worker while another idles (SGLang's cache-aware
router keeps a balance threshold of this kind). With no hit anywhere, or routing off,
the pool picks exactly as it does without an index (least-loaded, ties to the
first).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from disagg.engine.kv_blocks import DEFAULT_BLOCK_SIZE, block_hashes

ROUTER_SALT = "router"  # the index's own names: it estimates overlap, it never names a worker's blocks
PREFIX_INDEX_TOKENS = 262_144  # per worker: about one worker's KV cache (see the module docstring)
LOAD_PENALTY_BLOCKS = 1  # a worker must hold one more block of the prompt per request of extra load
# Prefills beyond the least-loaded worker's past which a hit no longer counts. A prefill worker's load
# (this router's prefills in flight + the queue it last reported) counts a prefill of ours that waits
# twice, and the reported queue is up to a poll old: 4 is about two prefills really waiting ahead.
PREFILL_QUEUE_SLACK = 4

W = TypeVar("W")


@dataclass(frozen=True)
class RoutedPrompt:
    """What the index knows of one prompt: its block hashes (empty: routed by load alone) and its length."""

    hashes: tuple[bytes, ...] = ()
    tokens: int = 0


class WorkerBlocks:
    """The block hashes one worker was sent, least recently sent first out."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._hashes: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def overlap(self, hashes: Sequence[bytes]) -> int:
        """How many of the leading hashes this worker holds."""
        count = 0
        for h in hashes:
            if h not in self._hashes:
                break
            count += 1
        return count

    def record(self, hashes: Sequence[bytes]) -> None:
        # Last block first, so a prompt's first blocks are the most recent and the last
        # evicted: without its first block the rest of a prefix can never match (the
        # workers' block pool releases a sequence's blocks in the same order).
        for h in reversed(hashes[: self.capacity]):
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)


class PrefixIndex:
    """Per worker (role, address), the blocks the router sent it. Disabled: no hashes, no index."""

    def __init__(
        self,
        block_size: int = DEFAULT_BLOCK_SIZE,
        enabled: bool = True,
        index_tokens: int = PREFIX_INDEX_TOKENS,
        observe: Callable[[str, int, int], None] | None = None,
    ):
        """observe(role, prompt tokens routed, of those the index held): metrics, for every routed prompt."""
        if block_size < 1:
            raise ValueError(f"--block-size must be at least 1, not {block_size}")
        self.block_size, self.enabled = block_size, enabled
        self.capacity = max(1, index_tokens // block_size)
        self._observe = observe
        self._workers: dict[tuple[str, str], WorkerBlocks] = {}

    def hashes(self, token_ids: list[int]) -> tuple[bytes, ...]:
        """The prompt's block hashes as the index names them; none when routing is off. About 0.2 ms per
        1,000 tokens: the router hashes on its tokenizer threads (core.py), never on the event loop."""
        if not self.enabled:
            return ()
        return tuple(block_hashes(token_ids, self.block_size, ROUTER_SALT, limit=self.capacity))

    def overlap(self, worker, prompt: RoutedPrompt) -> int:
        """Leading blocks of the prompt the worker was sent before (0 when routing is off)."""
        blocks = self._workers.get((worker.role, worker.address))
        return blocks.overlap(prompt.hashes) if blocks is not None and prompt.hashes else 0

    def record(self, worker, prompt: RoutedPrompt) -> None:
        """The prompt was routed to worker: it will hold these blocks."""
        hit = self.overlap(worker, prompt) * self.block_size
        if prompt.hashes:
            key = (worker.role, worker.address)
            self._workers.setdefault(key, WorkerBlocks(self.capacity)).record(prompt.hashes)
        if self._observe is not None and prompt.tokens:
            self._observe(worker.role, prompt.tokens, min(hit, prompt.tokens))

    def forget(self, worker) -> None:
        """The worker went away or restarted: whatever it held is gone (a stale entry would only cost a miss)."""
        self._workers.pop((worker.role, worker.address), None)

    def held(self, worker) -> int:
        """How many hashes the index keeps for worker (tests, debugging)."""
        blocks = self._workers.get((worker.role, worker.address))
        return len(blocks) if blocks is not None else 0


def choose_by_overlap(
    candidates: Sequence[W], load: Callable[[W], int], overlap: Callable[[W], int], block_size: int, max_extra_load: int | None = None
) -> W | None:
    """The candidate whose hit (overlap blocks * block_size tokens) most outweighs its load beyond the
    least-loaded candidate's (LOAD_PENALTY_BLOCKS blocks per request); None when no candidate's does,
    and the caller picks by load as it would without an index. A candidate more than max_extra_load
    requests above the least-loaded is not chosen for its hit. Ties: the less loaded, then the first."""
    if not candidates:
        return None
    least = min(load(w) for w in candidates)
    best, best_key = None, (0, 0)
    for worker in candidates:
        blocks, extra = overlap(worker), load(worker) - least
        if blocks == 0 or (max_extra_load is not None and extra > max_extra_load):
            continue
        key = ((blocks - LOAD_PENALTY_BLOCKS * extra) * block_size, -extra)
        if key[0] > 0 and key > best_key:
            best, best_key = worker, key
    return best  # None: no hit beats its load (the least-loaded candidate, hit or not, scores at least 0)
