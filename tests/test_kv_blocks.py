"""The block pool and the slot manager over it: tables, prefix hits, publication, eviction, release."""

import pytest

from disagg.engine.kv_blocks import NULL_BLOCK, BlockPool, NoFreeBlocks, block_hashes, blocks_for
from disagg.engine.slot_manager import SlotError, SlotManager

SALT = "model|float32"


def test_hashes_name_a_block_by_every_token_before_it_and_the_salt():
    a = block_hashes(list(range(40)), 16, SALT)
    assert len(a) == 2  # the partial third block is not named
    assert block_hashes(list(range(32)), 16, SALT) == a
    changed_first = block_hashes([99] + list(range(1, 40)), 16, SALT)
    assert changed_first[0] != a[0] and changed_first[1] != a[1]  # the second block's own tokens are equal: the chain differs
    assert block_hashes(list(range(40)), 16, "other|float32") != a
    assert block_hashes(list(range(40)), 16, SALT, limit=1) == a[:1]
    assert blocks_for(33, 16) == 3 and blocks_for(32, 16) == 2


def test_a_published_prefix_is_shared_and_outlives_its_first_reader():
    pool = BlockPool(num_blocks=10, block_size=4)
    hashes = block_hashes(list(range(12)), 4, SALT)
    first, hits = pool.allocate(hashes, 4)
    assert hits == 0 and NULL_BLOCK not in first and len(set(first)) == 4
    pool.publish(first, hashes)
    second, hits = pool.allocate(hashes[:2] + block_hashes(list(range(8)) + [7, 7, 7, 7], 4, SALT)[2:], 4)
    assert hits == 2 and second[:2] == first[:2] and not set(second[2:]) & set(first)
    pool.release(first)  # the first reader ends: the shared blocks stay, the unshared published one is cached
    assert pool.references(first[0]) == 1 and pool.cached_blocks == 1
    pool.release(second)
    assert pool.used_blocks == 0 and pool.cached_blocks == 3 and pool.stats.hit_tokens == 8
    pool.check_integrity()


def test_eviction_takes_the_least_recently_released_cached_block_first():
    pool = BlockPool(num_blocks=4, block_size=2)  # 3 usable
    old, new = block_hashes([1, 2], 2, SALT), block_hashes([3, 4], 2, SALT)
    table_old, _ = pool.allocate(old, 1)
    pool.publish(table_old, old)
    pool.release(table_old)
    table_new, _ = pool.allocate(new, 1)
    pool.publish(table_new, new)
    pool.release(table_new)
    taken, hits = pool.allocate([], 2)  # one free block, then the oldest cached one
    assert hits == 0 and table_old[0] in taken and pool.stats.evictions == 1
    assert pool.cached_prefix(old) == [] and pool.cached_prefix(new) == table_new
    with pytest.raises(NoFreeBlocks):
        pool.allocate([], 2)  # one left (the cached `new`): asking for two fails and takes nothing
    assert pool.cached_prefix(new) == table_new
    pool.check_integrity()


def test_a_hit_block_counts_once_when_room_is_judged():
    pool = BlockPool(num_blocks=3, block_size=2)  # 2 usable
    hashes = block_hashes([1, 2], 2, SALT)
    table, _ = pool.allocate(hashes, 1)
    pool.publish(table, hashes)
    pool.release(table)  # cached, unreferenced: both "available" and a hit
    assert pool.can_allocate(hashes, 2) and not pool.can_allocate(hashes, 3)
    table, hits = pool.allocate(hashes, 2)
    assert hits == 1 and pool.free_blocks == 0
    pool.check_integrity()


def test_without_caching_nothing_is_found_or_kept():
    pool = BlockPool(num_blocks=5, block_size=2, caching=False)
    hashes = block_hashes([1, 2, 3, 4], 2, SALT)
    table, _ = pool.allocate(hashes, 2)
    pool.publish(table, hashes)
    pool.release(table)
    assert pool.cached_blocks == 0 and pool.allocate(hashes, 2)[1] == 0


def test_slot_manager_publishes_on_activate_and_releases_only_its_own_references():
    pool = BlockPool(num_blocks=12, block_size=4)
    slots = SlotManager(3, blocks=pool)
    hashes = block_hashes(list(range(10)), 4, SALT)  # two full blocks
    a = slots.reserve("a", prompt_len=10, lease_seconds=5, block_hashes=hashes, total_blocks=4)
    b = slots.reserve("b", prompt_len=10, lease_seconds=5, block_hashes=hashes, total_blocks=4)
    assert a.cached_tokens == b.cached_tokens == 0  # a's KV has not landed: nothing is published before it has
    slots.activate(a.reservation_id)
    c = slots.reserve("c", prompt_len=10, lease_seconds=5, block_hashes=hashes, total_blocks=4)
    assert c.cached_tokens == 8 and c.table[:2] == a.table[:2]
    slots.release(a.reservation_id)  # a cancel of the first reader: c still reads the shared blocks
    assert all(pool.references(block) == 1 for block in c.table)
    slots.release(b.reservation_id)  # b never activated: its blocks were never published, all free again
    slots.check_integrity()
    slots.release(c.reservation_id)
    assert pool.used_blocks == 0 and pool.cached_blocks == 2
    slots.check_integrity()


def test_slot_manager_refuses_when_blocks_run_out_and_takes_nothing():
    slots = SlotManager(4, blocks=BlockPool(num_blocks=7, block_size=4))  # 6 usable
    slots.reserve("a", prompt_len=4, lease_seconds=5, total_blocks=4)
    assert not slots.can_reserve(total_blocks=3)
    with pytest.raises(SlotError, match="KV blocks"):
        slots.reserve("b", prompt_len=4, lease_seconds=5, total_blocks=3)
    assert slots.free_slots == 3 and slots.blocks.free_blocks == 2
    slots.check_integrity()
