"""BlockPool and its free queue: exact ids, ref counts, LRU order, cache map, the null block,
invariants. Block 0 is the null block, so a pool of n + 1 blocks hands out ids 1..n."""

from __future__ import annotations

import pytest

from aserve.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock, make_cache_key


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
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [1, 2, 3]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert free_ids(pool) == [4]
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(0.75)
    pool.check_invariants()
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    pool.check_invariants()


def test_free_blocks_appends_in_given_order_and_is_lru() -> None:
    pool = BlockPool(5)
    a = pool.get_new_blocks(2)  # 1, 2
    b = pool.get_new_blocks(2)  # 3, 4
    pool.free_blocks(reversed(b))
    pool.free_blocks(reversed(a))
    assert free_ids(pool) == [4, 3, 2, 1]
    assert [x.block_id for x in pool.get_new_blocks(3)] == [4, 3, 2]  # least recently freed first
    pool.check_invariants()


def test_shared_block_returns_to_queue_only_at_ref_zero() -> None:
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and free_ids(pool) == [2]
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and free_ids(pool) == [2, 1]
    with pytest.raises(ValueError):
        pool.free_blocks([block])
    pool.check_invariants()


def test_cache_full_blocks_registers_range_and_first_hash_wins() -> None:
    pool = BlockPool(7)
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
    assert pool.cached_blocks == {make_cache_key(h(1), 0): blocks[0],
                                  make_cache_key(h(2), 0): blocks[1]}
    pool.check_invariants()


def test_freed_hashed_block_stays_cached_until_popped() -> None:
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [h(1), h(2)], 0, 2)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [2, 1]
    assert pool.get_cached_block(h(1)) is blocks[0]
    (popped,) = pool.get_new_blocks(1)  # evicts block 2 (freed first)
    assert popped is blocks[1] and popped.block_hash is None
    assert pool.get_cached_block(h(2)) is None
    assert pool.get_cached_block(h(1)) is blocks[0]
    pool.check_invariants()


def test_touch_on_free_cached_block_removes_it_from_queue() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [h(1), h(2), h(3)], 0, 3)
    pool.free_blocks(blocks)
    pool.touch([pool.get_cached_block(h(2))])
    assert free_ids(pool) == [1, 3]
    assert blocks[1].ref_cnt == 1 and blocks[1].block_hash == h(2)
    pool.check_invariants()


def test_reset_prefix_cache_refuses_while_blocks_are_in_use() -> None:
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [h(1), h(2)], 0, 2)
    pool.free_blocks(blocks[:1])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(h(1)) is blocks[0]
    pool.free_blocks(blocks[1:])
    assert pool.reset_prefix_cache() is True
    assert pool.cached_blocks == {} and all(b.block_hash is None for b in blocks)
    assert pool.num_free_blocks == pool.num_blocks - 1
    pool.check_invariants()


def test_caching_disabled_registers_nothing() -> None:
    pool = BlockPool(3, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [h(1), h(2)], 0, 2)
    assert pool.cached_blocks == {} and blocks[0].block_hash is None


def test_check_invariants_catches_corruption() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(1)
    blocks[0].ref_cnt = 0  # held nowhere, yet missing from the queue
    with pytest.raises(AssertionError, match="ref-0"):
        pool.check_invariants()
    pool = BlockPool(4)
    pool.blocks[1].cache_key = make_cache_key(h(9), 0)  # key without a map entry
    with pytest.raises(AssertionError, match="map"):
        pool.check_invariants()
    pool = BlockPool(4)
    pool.blocks[3].prev_free = pool.blocks[1]  # broken back link
    with pytest.raises(AssertionError, match="prev link"):
        pool.check_invariants()


def test_pool_needs_a_block_besides_the_null_block() -> None:
    with pytest.raises(ValueError):
        BlockPool(1)
    pool = BlockPool(2)
    assert pool.num_free_blocks == 1 and pool.usage == 0.0


def test_null_block_is_never_handed_out_freed_touched_or_cached() -> None:
    pool = BlockPool(4)
    null = pool.null_block
    assert null.block_id == 0 and null.is_null and 0 not in free_ids(pool)
    assert pool.num_free_blocks == 3 and pool.usage == 0.0
    blocks = pool.get_new_blocks(3)
    assert null not in blocks and pool.usage == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.touch([null, blocks[0]])  # the null block stands for a skipped slot: no reference
    pool.free_blocks([null, blocks[0], null])
    assert null.ref_cnt == 0 and blocks[0].ref_cnt == 1
    pool.cache_full_blocks([null, blocks[1]], [h(1), h(2)], 0, 2)
    assert null.cache_key is None and pool.get_cached_block(h(1)) is None
    assert pool.get_cached_block(h(2)) is blocks[1]
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 3 and 0 not in free_ids(pool)
    assert pool.reset_prefix_cache() is True
    pool.check_invariants()


def test_cache_keys_separate_groups() -> None:
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [h(1)], 0, 1, group_id=0)
    pool.cache_full_blocks([b], [h(1)], 0, 1, group_id=1)  # same hash, another group: cached
    assert pool.get_cached_block(h(1), 0) is a and pool.get_cached_block(h(1), 1) is b
    assert pool.get_cached_block(h(1), 2) is None
    assert a.block_hash == b.block_hash == h(1) and a.cache_key != b.cache_key
    pool.check_invariants()
