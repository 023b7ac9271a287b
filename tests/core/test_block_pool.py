"""BlockPool and its free queue: exact ids, ref counts, LRU order, cache map, invariants."""

from __future__ import annotations

import pytest

from aserve.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue.get_all_free_blocks()]


def h(i: int) -> bytes:
    return bytes([i]) * 32


def test_free_queue_starts_in_id_order_and_supports_o1_ops() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert [b.block_id for b in queue.get_all_free_blocks()] == [0, 1, 2, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.remove(blocks[2])
    queue.append(blocks[0])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [1, 3, 4, 0]
    assert queue.num_free_blocks == 4
    assert blocks[2].prev_free is None and blocks[2].next_free is None


def test_free_queue_errors() -> None:
    blocks = [KVCacheBlock(0)]
    queue = FreeBlockQueue(blocks)
    queue.popleft()
    with pytest.raises(ValueError):
        queue.popleft()
    with pytest.raises(ValueError):
        queue.remove(blocks[0])


def test_get_new_blocks_pops_head_with_ref_one() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert free_ids(pool) == [3]
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(0.75)
    pool.check_invariants()
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    pool.check_invariants()


def test_free_blocks_appends_in_given_order_and_is_lru() -> None:
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)  # 0, 1
    b = pool.get_new_blocks(2)  # 2, 3
    pool.free_blocks(reversed(b))
    pool.free_blocks(reversed(a))
    assert free_ids(pool) == [3, 2, 1, 0]
    assert [x.block_id for x in pool.get_new_blocks(3)] == [3, 2, 1]  # least recently freed first
    pool.check_invariants()


def test_shared_block_returns_to_queue_only_at_ref_zero() -> None:
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and free_ids(pool) == [1]
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and free_ids(pool) == [1, 0]
    with pytest.raises(ValueError):
        pool.free_blocks([block])
    pool.check_invariants()


def test_cache_full_blocks_registers_range_and_first_hash_wins() -> None:
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [h(1), h(2), h(3)], num_cached_blocks=1, num_full_blocks=2)
    assert blocks[0].block_hash is None and blocks[2].block_hash is None
    assert blocks[1].block_hash == h(2)
    assert pool.get_cached_block(h(2)) is blocks[1]
    assert pool.get_cached_block(h(1)) is None
    dup = pool.get_new_blocks(1)
    pool.cache_full_blocks(dup, [h(2)], 0, 1)
    assert dup[0].block_hash is None and pool.get_cached_block(h(2)) is blocks[1]
    pool.cache_full_blocks(blocks, [h(1), h(2)], 0, 2)  # already cached block: left alone
    assert pool.cached_blocks == {h(1): blocks[0], h(2): blocks[1]}
    pool.check_invariants()


def test_freed_hashed_block_stays_cached_until_popped() -> None:
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [h(1), h(2)], 0, 2)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [1, 0]
    assert pool.get_cached_block(h(1)) is blocks[0]
    (popped,) = pool.get_new_blocks(1)  # evicts block 1 (freed first)
    assert popped is blocks[1] and popped.block_hash is None
    assert pool.get_cached_block(h(2)) is None
    assert pool.get_cached_block(h(1)) is blocks[0]
    pool.check_invariants()


def test_touch_on_free_cached_block_removes_it_from_queue() -> None:
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [h(1), h(2), h(3)], 0, 3)
    pool.free_blocks(blocks)
    pool.touch([pool.get_cached_block(h(2))])
    assert free_ids(pool) == [0, 2]
    assert blocks[1].ref_cnt == 1 and blocks[1].block_hash == h(2)
    pool.check_invariants()


def test_reset_prefix_cache_refuses_while_blocks_are_in_use() -> None:
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [h(1), h(2)], 0, 2)
    pool.free_blocks(blocks[:1])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(h(1)) is blocks[0]
    pool.free_blocks(blocks[1:])
    assert pool.reset_prefix_cache() is True
    assert pool.cached_blocks == {} and all(b.block_hash is None for b in blocks)
    pool.check_invariants()


def test_caching_disabled_registers_nothing() -> None:
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [h(1), h(2)], 0, 2)
    assert pool.cached_blocks == {} and blocks[0].block_hash is None


def test_check_invariants_catches_corruption() -> None:
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(1)
    blocks[0].ref_cnt = 0  # held nowhere, yet missing from the queue
    with pytest.raises(AssertionError, match="ref-0"):
        pool.check_invariants()
    pool = BlockPool(3)
    pool.blocks[1].block_hash = h(9)  # hash without a map entry
    with pytest.raises(AssertionError, match="map"):
        pool.check_invariants()
    pool = BlockPool(3)
    pool.blocks[2].prev_free = pool.blocks[0]  # broken back link
    with pytest.raises(AssertionError, match="prev link"):
        pool.check_invariants()


def test_pool_needs_at_least_one_block() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)
