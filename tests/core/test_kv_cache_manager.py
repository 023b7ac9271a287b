"""KVCacheManager with one full-attention group: allocation, prefix hits, the one-token cap, LRU
eviction, stats, invariants. Block 0 is the null block: a manager of n + 1 blocks hands out
ids 1..n, so ids here are one more than a pool without it would give. Hybrid (several group)
behaviour is in test_hybrid_kv_cache.py."""

from __future__ import annotations

import random

import pytest
from helpers.requests import make_request

from aserve.core.kv_cache_manager import KVCacheManager
from aserve.core.request import Request

BS = 4  # block size in every test


def free_ids(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_queue.get_all_free_blocks()]


def ids(manager: KVCacheManager, req_id: str) -> list[int]:
    (block_ids,) = manager.get_block_ids(req_id)
    return block_ids


def hit_ids(blocks: tuple) -> list[int]:
    (group_blocks,) = blocks
    return [b.block_id for b in group_blocks]


def schedule(manager: KVCacheManager, request: Request, num_new_tokens: int) -> list[int] | None:
    """What the scheduler does for one request: look up its prefix, allocate, mark computed.
    Returns the new block ids of the one group."""
    blocks, num_hit = None, 0
    if request.num_computed_tokens == 0:
        blocks, num_hit = manager.get_computed_blocks(request)
    new_ids = manager.allocate_slots(request, num_new_tokens - num_hit, num_hit, blocks)
    if new_ids is not None:
        request.num_computed_tokens += num_new_tokens
    manager.check_invariants()
    return None if new_ids is None else list(new_ids[0])


def held(manager: KVCacheManager) -> dict:
    return manager.coordinator.managers[0].req_to_blocks


def num_cached(manager: KVCacheManager) -> dict:
    return manager.coordinator.managers[0].num_cached_blocks


def test_allocate_hands_out_blocks_in_id_order_and_registers_full_ones() -> None:
    manager = KVCacheManager(num_blocks=7, block_size=BS)
    request = make_request("a", list(range(10)))
    assert manager.allocate_slots(request, 10) == ([1, 2, 3],)
    assert manager.get_block_ids("a") == ([1, 2, 3],)
    assert free_ids(manager) == [4, 5, 6]
    pool = manager.block_pool
    assert [pool.blocks[i].ref_cnt for i in range(7)] == [0, 1, 1, 1, 0, 0, 0]
    assert [pool.blocks[1].block_hash, pool.blocks[2].block_hash] == request.block_hashes
    assert pool.blocks[3].block_hash is None  # not full
    assert manager.num_free_blocks == 3 and manager.usage == pytest.approx(0.5)
    manager.check_invariants()


def test_chunked_prefill_then_decode_grow_blocks_one_at_a_time() -> None:
    manager = KVCacheManager(num_blocks=9, block_size=BS)
    request = make_request("a", list(range(6)))
    assert schedule(manager, request, 4) == [1]
    assert manager.block_pool.get_cached_block(request.block_hashes[0]).block_id == 1
    assert schedule(manager, request, 2) == [2]
    for token, expected in [(100, []), (101, []), (102, [3])]:  # decode: 7, 8, 9 tokens
        request.append_output_token_ids([token])
        assert schedule(manager, request, 1) == expected
    assert ids(manager, "a") == [1, 2, 3]
    assert manager.block_pool.blocks[2].block_hash == request.block_hashes[1]
    assert num_cached(manager)["a"] == 2


def test_prefix_hit_shares_blocks_between_running_requests() -> None:
    manager = KVCacheManager(num_blocks=9, block_size=BS)
    a = make_request("a", list(range(10)))
    schedule(manager, a, 10)
    b = make_request("b", list(range(8)) + [50, 51, 52])
    blocks, num_hit = manager.get_computed_blocks(b)
    assert hit_ids(blocks) == [1, 2] and num_hit == 8
    assert [x.ref_cnt for x in blocks[0]] == [1, 1]  # lookup takes no reference
    assert manager.allocate_slots(b, 3, num_hit, blocks) == ([4],)
    assert ids(manager, "b") == [1, 2, 4]
    assert [manager.block_pool.blocks[i].ref_cnt for i in range(1, 5)] == [2, 2, 1, 1]
    manager.check_invariants()
    manager.free(a)
    assert free_ids(manager) == [5, 6, 7, 8, 3]
    assert [manager.block_pool.blocks[i].ref_cnt for i in range(1, 5)] == [1, 1, 0, 1]
    manager.check_invariants()


def test_hit_is_capped_to_leave_one_token_to_compute() -> None:
    manager = KVCacheManager(num_blocks=9, block_size=BS)
    schedule(manager, make_request("a", list(range(12))), 12)
    same = make_request("b", list(range(8)))  # two full blocks, both cached
    blocks, num_hit = manager.get_computed_blocks(same)
    assert hit_ids(blocks) == [1] and num_hit == 4
    longer = make_request("c", list(range(9)))
    assert manager.get_computed_blocks(longer)[1] == 8
    gap = make_request("d", [0, 1, 2, 3, 9, 9, 9, 9] + list(range(8, 12)) + [0])
    blocks, num_hit = manager.get_computed_blocks(gap)  # block 2 differs through its parent
    assert hit_ids(blocks) == [1] and num_hit == 4


def test_free_releases_tail_first_so_head_blocks_are_evicted_last() -> None:
    manager = KVCacheManager(num_blocks=7, block_size=BS)
    a = make_request("a", list(range(12)))
    b = make_request("b", list(range(100, 108)))
    schedule(manager, a, 12)  # blocks 1, 2, 3
    schedule(manager, b, 8)  # blocks 4, 5
    manager.free(b)
    manager.free(a)
    assert free_ids(manager) == [6, 5, 4, 3, 2, 1]
    assert ids(manager, "a") == [] and manager.num_free_blocks == 6
    c = make_request("c", list(range(200, 216)))
    assert schedule(manager, c, 16) == [6, 5, 4, 3]  # b's blocks evicted before a's head
    a_again = make_request("a2", list(range(12)))
    blocks, num_hit = manager.get_computed_blocks(a_again)
    assert hit_ids(blocks) == [1, 2] and num_hit == 8  # block 3 was evicted


def test_preempted_request_hits_its_own_blocks_on_resume() -> None:
    manager = KVCacheManager(num_blocks=7, block_size=BS)
    request = make_request("a", list(range(10)))
    schedule(manager, request, 10)
    manager.free(request)
    request.num_computed_tokens = 0
    assert free_ids(manager) == [4, 5, 6, 3, 2, 1]
    assert schedule(manager, request, 10) == [4]
    assert ids(manager, "a") == [1, 2, 4]
    assert free_ids(manager) == [5, 6, 3]
    assert manager.prefix_cache_hits == 8


def test_allocate_returns_none_and_changes_nothing_when_out_of_blocks() -> None:
    manager = KVCacheManager(num_blocks=5, block_size=BS)
    schedule(manager, make_request("a", list(range(12))), 12)
    b = make_request("b", list(range(100, 108)))
    before = (free_ids(manager), dict(held(manager)), num_cached(manager).copy())
    assert manager.allocate_slots(b, 8) is None
    assert (free_ids(manager), dict(held(manager)), num_cached(manager)) == before
    assert manager.get_block_ids("b") == ([],) and not manager.holds_blocks("b")
    manager.free(b)  # unknown to the manager: a no-op
    assert free_ids(manager) == [4]
    manager.check_invariants()


def test_free_computed_blocks_do_not_count_as_available() -> None:
    manager = KVCacheManager(num_blocks=5, block_size=BS)
    a = make_request("a", list(range(9)))
    schedule(manager, a, 9)  # blocks 1, 2 (cached), 3
    manager.free(a)
    assert free_ids(manager) == [4, 3, 2, 1] and manager.num_free_blocks == 4
    big = make_request("big", list(range(17)))  # needs 5 blocks: 2 hit + 3 new > 4 - 2
    blocks, num_hit = manager.get_computed_blocks(big)
    assert hit_ids(blocks) == [1, 2]
    assert manager.allocate_slots(big, 17 - num_hit, num_hit, blocks) is None
    assert free_ids(manager) == [4, 3, 2, 1]
    assert [x.ref_cnt for x in blocks[0]] == [0, 0] and manager.get_block_ids("big") == ([],)
    manager.check_invariants()
    fits = make_request("fits", list(range(16)))  # 2 hit + 2 new == 4 - 2
    blocks, num_hit = manager.get_computed_blocks(fits)
    assert manager.allocate_slots(fits, 16 - num_hit, num_hit, blocks) == ([4, 3],)
    assert ids(manager, "fits") == [1, 2, 4, 3] and manager.num_free_blocks == 0
    manager.check_invariants()


def test_stats_count_queried_and_hit_tokens() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    schedule(manager, make_request("a", list(range(10))), 10)
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (10, 0)
    schedule(manager, make_request("b", list(range(9))), 9)
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (19, 8)


def test_prompt_logprobs_bypass_the_cache_lookup() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    schedule(manager, make_request("a", list(range(10))), 10)
    queries = manager.prefix_cache_queries
    b = make_request("b", list(range(10)), prompt_logprobs=0)
    assert manager.get_computed_blocks(b) == (([],), 0)
    assert manager.prefix_cache_queries == queries and manager.prefix_cache_hits == 0


def test_caching_disabled_never_hits_nor_registers() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = make_request("a", list(range(10)))
    assert schedule(manager, a, 10) == [1, 2, 3]
    assert manager.block_pool.cached_blocks == {}
    assert manager.get_computed_blocks(make_request("b", list(range(10)))) == (([],), 0)
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (0, 0)


def test_cache_salt_separates_prefixes() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    schedule(manager, make_request("a", list(range(10)), cache_salt="x"), 10)
    assert manager.get_computed_blocks(make_request("b", list(range(10))))[1] == 0
    assert manager.get_computed_blocks(make_request("c", list(range(10)), cache_salt="y"))[1] == 0
    assert manager.get_computed_blocks(make_request("d", list(range(10)), cache_salt="x"))[1] == 8


def test_duplicate_content_keeps_first_registration() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(8)))
    b = make_request("b", list(range(8)))
    manager.allocate_slots(a, 8)
    manager.allocate_slots(b, 8)  # computed without a lookup: same hashes, blocks 3, 4
    pool = manager.block_pool
    assert pool.get_cached_block(b.block_hashes[0]).block_id == 1
    assert pool.blocks[3].block_hash is None and pool.blocks[4].block_hash is None
    manager.free(a)
    manager.free(b)
    assert free_ids(manager) == [5, 6, 7, 2, 1, 4, 3]
    manager.check_invariants()


def test_reset_prefix_cache_refuses_while_blocks_are_in_use() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(10)))
    schedule(manager, a, 10)
    assert manager.reset_prefix_cache() is False
    assert manager.get_computed_blocks(make_request("b", list(range(10))))[1] == 8
    manager.free(a)
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(make_request("c", list(range(10))))[1] == 0
    manager.check_invariants()


def test_check_invariants_catches_a_wrong_ref_count() -> None:
    manager = KVCacheManager(num_blocks=5, block_size=BS)
    schedule(manager, make_request("a", list(range(5))), 5)
    manager.block_pool.blocks[1].ref_cnt = 2
    pytest.raises(AssertionError, manager.check_invariants).match("held by 1")


def test_random_workload_keeps_invariants_and_ends_all_free() -> None:
    rng = random.Random(0)
    manager = KVCacheManager(num_blocks=24, block_size=BS)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 14))] for _ in range(3)]
    running: list[Request] = []
    for step in range(300):
        if len(running) < 5 and rng.random() < 0.4:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(4))]
            request = make_request(f"r{step}", tokens)
            if schedule(manager, request, len(tokens)) is not None:
                running.append(request)
        for request in list(running):
            if rng.random() < 0.2:
                manager.free(request)
                running.remove(request)
            else:
                request.append_output_token_ids([rng.randrange(50)])
                if schedule(manager, request, 1) is None:
                    manager.free(request)
                    running.remove(request)
    for request in running:
        manager.free(request)
    manager.check_invariants()
    assert manager.num_free_blocks == manager.num_blocks - 1 and manager.prefix_cache_hits > 0
