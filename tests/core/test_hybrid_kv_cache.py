"""The hybrid KV cache: full-attention and sliding-window groups over one pool, block by block.

In the style of vLLM's hybrid prefix-caching tests: exact block ids per group (block 0 is the
null block, so fresh ids start at 1 and are handed out group by group), hits that agree across
groups, what evicting each kind of block does to a hit, out-of-window blocks freed as the
window passes and still hit until evicted, and the allocation order (check, skip, touch every
group's hit, allocate) that keeps one group from evicting another's hit.
"""

from __future__ import annotations

import pytest
from helpers.requests import make_request

from aserve.core.block_pool import BlockPool, KVCacheBlock
from aserve.core.kv_cache_manager import KVCacheManager
from aserve.core.kv_cache_utils import make_kv_cache_groups
from aserve.core.request import Request

BS = 4


def make_manager(windows: list[int | None], num_blocks: int = 64, block_size: int = BS,
                 caching: bool = True) -> KVCacheManager:
    """A manager for a model whose layer i has window `windows[i]` (None: full attention)."""
    return KVCacheManager(num_blocks, block_size, caching,
                          make_kv_cache_groups(windows, block_size))


def ids(blocks: tuple[list[KVCacheBlock], ...]) -> tuple[list[int], ...]:
    return tuple([b.block_id for b in group] for group in blocks)


def run(manager: KVCacheManager, request: Request, num_new_tokens: int) -> tuple | None:
    """What the scheduler does for one request this step: look up a prefix (new requests),
    allocate, mark the tokens computed; check the invariants."""
    hit, num_hit = None, 0
    if request.num_computed_tokens == 0:
        hit, num_hit = manager.get_computed_blocks(request)
    new_ids = manager.allocate_slots(request, num_new_tokens - num_hit, num_hit, hit)
    if new_ids is not None:
        request.num_computed_tokens += num_new_tokens
    manager.check_invariants()
    return new_ids


def decode(manager: KVCacheManager, request: Request, token: int = 7) -> tuple | None:
    request.append_output_token_ids([token])
    return run(manager, request, 1)


def evict(pool: BlockPool, block_id: int) -> None:
    """Drop a block from the prefix cache, as reusing it for a new allocation would."""
    block = pool.blocks[block_id]
    del pool.cached_blocks[block.cache_key]
    block.cache_key = None


def to_queue_tail(pool: BlockPool, block_ids: list[int]) -> None:
    """Move free blocks to the free queue's tail, in order (as a hit and a free would)."""
    for block_id in block_ids:
        pool.touch([pool.blocks[block_id]])
        pool.free_blocks([pool.blocks[block_id]])


# ---------------------------------------------------------------------- exact hits


def test_full_plus_sliding_hit_has_null_blocks_behind_the_window() -> None:
    # W = 6, block_size 4: a hit of length L needs the ceil(5 / 4) = 2 blocks ending at L.
    manager = make_manager([None, 6])
    a = make_request("a", list(range(20)))
    assert run(manager, a, 20) == ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    b = make_request("b", list(range(20)) + [99])
    hit, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 20
    assert ids(hit) == ([1, 2, 3, 4, 5], [0, 0, 0, 9, 10])
    assert manager.allocate_slots(b, 1, num_hit, hit) == ([11], [12])
    assert manager.get_block_ids("b") == ([1, 2, 3, 4, 5, 11], [0, 0, 0, 9, 10, 12])
    refs = [manager.block_pool.blocks[i].ref_cnt for i in range(13)]
    assert refs == [0, 2, 2, 2, 2, 2, 1, 1, 1, 2, 2, 1, 1]  # the null block is never counted
    manager.check_invariants()


def test_full_plus_two_windows_hit_per_group() -> None:
    # Groups: full, W = 3 (needs 1 block), W = 9 (needs 2); ids 1-5, 6-10, 11-15.
    manager = make_manager([None, 3, 9])
    assert [g.sliding_window for g in manager.groups] == [None, 3, 9]
    run(manager, make_request("a", list(range(20))), 20)
    hit, num_hit = manager.get_computed_blocks(make_request("b", list(range(21))))
    assert num_hit == 20
    assert ids(hit) == ([1, 2, 3, 4, 5], [0, 0, 0, 0, 10], [0, 0, 0, 14, 15])


def test_hit_never_covers_the_last_token_and_skips_prompt_logprobs() -> None:
    manager = make_manager([None, 6])
    run(manager, make_request("a", list(range(20))), 20)
    hit, num_hit = manager.get_computed_blocks(make_request("b", list(range(20))))
    assert num_hit == 16 and ids(hit) == ([1, 2, 3, 4], [0, 0, 8, 9])
    b = make_request("c", list(range(20)), prompt_logprobs=1)
    assert manager.get_computed_blocks(b) == (([], []), 0)


def test_groups_never_hit_each_others_blocks() -> None:
    manager = make_manager([None, 6])
    a = make_request("a", list(range(8)))
    run(manager, a, 8)  # full 1, 2; sliding 3, 4: the same hashes, one key per group
    pool = manager.block_pool
    assert [pool.get_cached_block(h, 0).block_id for h in a.block_hashes] == [1, 2]
    assert [pool.get_cached_block(h, 1).block_id for h in a.block_hashes] == [3, 4]
    assert pool.get_cached_block(a.block_hashes[0], 2) is None


# ---------------------------------------------------------------------- eviction


@pytest.fixture
def shared() -> KVCacheManager:
    """Full + W = 6 with request a's 20 tokens cached: full 1-5, sliding 6-10."""
    manager = make_manager([None, 6])
    run(manager, make_request("a", list(range(20))), 20)
    return manager


def hit_of(manager: KVCacheManager, num_tokens: int = 21) -> tuple:
    hit, num_hit = manager.get_computed_blocks(make_request("b", list(range(num_tokens))))
    return ids(hit), num_hit


def test_evicting_an_out_of_window_sliding_block_keeps_the_hit(shared: KVCacheManager) -> None:
    evict(shared.block_pool, 6)
    evict(shared.block_pool, 8)
    assert hit_of(shared) == (([1, 2, 3, 4, 5], [0, 0, 0, 9, 10]), 20)


def test_evicting_an_in_window_sliding_block_shortens_the_hit(shared: KVCacheManager) -> None:
    evict(shared.block_pool, 10)  # the last block: the hit ends where 8, 9 are the window
    assert hit_of(shared) == (([1, 2, 3, 4], [0, 0, 8, 9]), 16)


def test_evicting_a_full_block_shortens_every_group(shared: KVCacheManager) -> None:
    evict(shared.block_pool, 3)
    assert hit_of(shared) == (([1, 2], [6, 7]), 8)


def test_a_shorter_length_searches_a_sliding_group_again() -> None:
    # full, W = 3, W = 9. W = 9 loses block 14 (index 3) after W = 3 found its hit at 20: the
    # length drops to 12, and W = 3 must find another block (8, not 10) ending there.
    manager = make_manager([None, 3, 9])
    run(manager, make_request("a", list(range(20))), 20)
    evict(manager.block_pool, 14)
    assert hit_of(manager) == (([1, 2, 3], [0, 0, 8], [0, 12, 13]), 12)


def test_a_sliding_run_from_block_zero_is_a_hit_even_if_shorter_than_the_window() -> None:
    manager = make_manager([None, 17])  # needs 4 blocks ending at the hit
    run(manager, make_request("a", list(range(20))), 20)
    evict(manager.block_pool, 9)  # sliding index 3: the run 6, 7, 8 from block 0 is the hit
    assert hit_of(manager) == (([1, 2, 3], [6, 7, 8]), 12)


# ---------------------------------------------------------------------- the window passing


def test_out_of_window_blocks_are_freed_during_decode_and_stay_hits_until_evicted() -> None:
    manager = make_manager([6], num_blocks=9)  # all sliding, W = 6: 8 usable blocks
    pool = manager.block_pool
    a = make_request("a", list(range(16)))
    assert run(manager, a, 16) == ([1, 2, 3, 4],)
    assert manager.num_free_blocks == 4
    assert decode(manager, a) == ([5],)  # at 16 computed, blocks 1, 2 are behind [11, 16]
    assert manager.get_block_ids("a") == ([0, 0, 3, 4, 5],)
    assert manager.num_free_blocks == 5  # rose: two freed, one new
    free_ids = [b.block_id for b in pool.free_queue.get_all_free_blocks()]
    assert free_ids == [6, 7, 8, 2, 1]  # the last skipped block freed first, as in vLLM
    held = []
    for _ in range(11):  # takes 6, 7, 8 as new blocks, frees 3, 4, 5 behind the window
        decode(manager, a)
        held.append(sum(b != 0 for b in manager.get_block_ids("a")[0]))
    assert set(held) == {2, 3} and manager.num_free_blocks == 8 - held[-1]  # ~W / bs + 1
    # a's first blocks were freed but kept their keys: a prompt of its first 12 tokens hits
    # them (it needs the 2 blocks ending at 12: 2 and 3).
    hit, num_hit = manager.get_computed_blocks(make_request("b", list(range(12)) + [50]))
    assert num_hit == 12 and ids(hit) == ([0, 2, 3],)
    pool.get_new_blocks(pool.num_free_blocks)  # every free block reused: keys evicted
    assert manager.get_computed_blocks(make_request("c", list(range(12)) + [50]))[1] == 0


def test_freed_out_of_window_block_is_hit_by_a_later_request() -> None:
    manager = make_manager([None, 6], num_blocks=32)
    a = make_request("a", list(range(16)))
    run(manager, a, 16)  # full 1-4, sliding 5-8
    decode(manager, a)  # sliding 5, 6 freed (keys kept)
    assert manager.get_block_ids("a")[1][:2] == [0, 0]
    assert [manager.block_pool.blocks[i].ref_cnt for i in (5, 6)] == [0, 0]
    hit, num_hit = manager.get_computed_blocks(make_request("b", list(range(8)) + [99]))
    assert num_hit == 8 and ids(hit) == ([1, 2], [5, 6])  # both back from the free queue
    manager.check_invariants()


# ---------------------------------------------------------------------- allocation order


def test_allocation_never_evicts_another_groups_hit() -> None:
    # full + W = 5 (needs 1 block); 5 usable blocks. a (8 tokens): full 1, 2; sliding 3, 4.
    manager = make_manager([None, 5], num_blocks=6)
    a = make_request("a", list(range(8)))
    run(manager, a, 8)
    manager.free(a)
    pool = manager.block_pool
    to_queue_tail(pool, [5, 2, 1, 3])  # queue: 4 (the sliding hit), 5, 2, 1, 3
    b = make_request("b", list(range(9)))
    hit, num_hit = manager.get_computed_blocks(b)
    assert ids(hit) == ([1, 2], [0, 4]) and num_hit == 8
    # Needs 1 + 1 new blocks and takes 3 free hit blocks: 5 of 5. Had the full group allocated
    # before the sliding group took block 4, it would have popped (evicted) 4.
    assert manager.allocate_slots(b, 1, num_hit, hit) == ([5], [3])
    assert manager.get_block_ids("b") == ([1, 2, 5], [0, 4, 3])
    manager.check_invariants()


def test_failed_allocation_changes_nothing_not_even_the_skipped_blocks() -> None:
    manager = make_manager([None, 6], num_blocks=7)  # 6 usable
    a = make_request("a", list(range(12)))
    run(manager, a, 12)  # full 1-3, sliding 4-6: no free block
    before = manager.get_block_ids("a")
    a.append_output_token_ids([1])
    # Needs a block in each group; the skip would free sliding 4 (0..3, behind [7, 12]) only.
    assert manager.allocate_slots(a, 1) is None
    assert manager.get_block_ids("a") == before and manager.num_free_blocks == 0
    manager.check_invariants()


def test_blocks_the_skip_frees_count_as_free() -> None:
    manager = make_manager([5], num_blocks=4)  # all sliding, 3 usable
    a = make_request("a", list(range(12)))
    assert run(manager, a, 12) == ([1, 2, 3],)
    assert manager.num_free_blocks == 0
    assert decode(manager, a) == ([2],)  # 1 and 2 freed (2 last, so popped first)
    assert manager.get_block_ids("a") == ([0, 0, 3, 2],)


def test_free_returns_every_group_and_resets() -> None:
    manager = make_manager([None, 6, None, 9], num_blocks=40)
    requests = [make_request(f"r{i}", list(range(i, i + 23))) for i in range(3)]
    for request in requests:
        run(manager, request, 23)
        for _ in range(9):
            decode(manager, request)
    for request in requests:
        manager.free(request)
    manager.check_invariants()
    assert manager.num_free_blocks == 39 and manager.usage == 0.0
    assert manager.reset_prefix_cache() and not manager.block_pool.cached_blocks


# ---------------------------------------------------------------------- edge windows


def test_window_not_a_multiple_of_the_block_size_keeps_the_partial_block() -> None:
    manager = make_manager([7])  # W = 7, block_size 4: at 13 computed, keys from 7 on
    a = make_request("a", list(range(13)))
    run(manager, a, 13)  # blocks 1-4
    decode(manager, a)  # at 13: only block 1 (0..3) is wholly before 7
    assert manager.get_block_ids("a") == ([0, 2, 3, 4],)


def test_block_size_one() -> None:
    manager = make_manager([None, 3], block_size=1)
    run(manager, make_request("a", list(range(5))), 5)  # full 1-5, sliding 6-10
    hit, num_hit = manager.get_computed_blocks(make_request("b", list(range(6))))
    assert num_hit == 5 and ids(hit) == ([1, 2, 3, 4, 5], [0, 0, 0, 9, 10])
    b = make_request("c", list(range(5)) + [9])
    run(manager, b, 6)
    assert manager.get_block_ids("c") == ([1, 2, 3, 4, 5, 11], [0, 0, 0, 9, 10, 12])
    decode(manager, b)  # at 6 computed, W = 3 reads 4, 5, 6: 9 is behind; new: 13, 14
    assert manager.get_block_ids("c") == ([1, 2, 3, 4, 5, 11, 13], [0, 0, 0, 0, 10, 12, 14])


def test_window_one_keeps_only_the_current_block() -> None:
    manager = make_manager([None, 1])
    a = make_request("a", list(range(12)))
    run(manager, a, 12)  # full 1-3, sliding 4-6
    hit, num_hit = manager.get_computed_blocks(make_request("b", list(range(13))))
    assert num_hit == 12 and ids(hit) == ([1, 2, 3], [0, 0, 6])
    decode(manager, a)  # at 12: every earlier block is behind a window of one token
    assert manager.get_block_ids("a") == ([1, 2, 3, 7], [0, 0, 0, 8])


def test_caching_off_hits_nothing_in_any_group() -> None:
    manager = make_manager([None, 6], caching=False)
    run(manager, make_request("a", list(range(20))), 20)
    assert manager.get_computed_blocks(make_request("b", list(range(21)))) == (([], []), 0)
    assert not manager.block_pool.cached_blocks
