"""`KVCacheCoordinator`: one request's blocks over every KV cache group, from one `BlockPool`.

Each group (`CacheConfig.groups`: full attention first, then sliding windows) has its own
`SingleTypeKVCacheManager` and its own block list per request; all lists cover the same tokens
with the same block size, and draw from (and return to) the one pool. A block belongs to one
group at a time: its cache key names the group.

    request r, block_size 4, 14 tokens computed; group 1 slides with W = 5
        group 0 (full):     [ b3 ][ b7 ][ b1 ][ b9 ]
        group 1 (sliding):  [null][null][ b4 ][ b6 ]      positions < 10 are never read again

A prefix hit must hold in every group at the same length. Each group's longest hit is found
with the current length as its bound, the length becomes the shortest, and this repeats until
no group shortens it (a full-attention hit is only truncated: any prefix of it is a hit; a
sliding one is searched again, as a shorter length needs other blocks).

`allocate_slots` counts the free blocks every group needs before it changes anything; then it
frees the blocks sliding groups no longer read, takes every group's hit blocks (so no group's
new blocks evict another's hit), allocates new blocks per group, and registers full ones.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from aserve.config import KVCacheGroupSpec
from aserve.core.block_pool import BlockPool, KVCacheBlock, split_cache_key
from aserve.core.hashing import update_block_hashes
from aserve.core.request import Request
from aserve.core.single_type_kv_cache_manager import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    make_single_type_manager,
)

GroupBlocks = tuple[list[KVCacheBlock], ...]  # one list per group, in group order


class KVCacheCoordinator:
    """The managers of `groups` over `pool`; every method covers all groups at once."""

    def __init__(self, groups: Sequence[KVCacheGroupSpec], pool: BlockPool) -> None:
        if not groups:
            raise ValueError("KVCacheCoordinator needs at least one KV cache group.")
        block_sizes = {g.block_size for g in groups}
        if len(block_sizes) != 1:
            raise ValueError(f"KV cache groups must share one block size, got {block_sizes}.")
        self.groups = tuple(groups)
        self.block_size = groups[0].block_size
        self.pool = pool
        self.managers: list[SingleTypeKVCacheManager] = [
            make_single_type_manager(group, pool, group_id)
            for group_id, group in enumerate(groups)]
        # Every group keeps all its blocks: then `covers` can tell that a request needs nothing
        self._all_full = all(isinstance(m, FullAttentionManager) for m in self.managers)
        # What a request that needs no block gets back (most decodes): shared, read-only
        self.no_new_blocks: tuple[Sequence[int], ...] = tuple(() for _ in self.managers)

    @property
    def num_groups(self) -> int:
        return len(self.managers)

    def empty_blocks(self) -> GroupBlocks:
        return tuple([] for _ in self.managers)

    def holds(self, req_id: str) -> bool:
        """Whether `req_id` has been allocated (it may hold only null blocks)."""
        return req_id in self.managers[0].req_to_blocks

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes],
                               max_length: int) -> tuple[GroupBlocks, int]:
        """The hit blocks per group and the hit length in tokens, the same for every group."""
        size = self.block_size
        length = min(max_length, len(block_hashes) * size) // size * size
        hits: list[list[KVCacheBlock] | None] = [None] * self.num_groups
        while True:
            start = length
            for group_id, manager in enumerate(self.managers):
                hit = hits[group_id]
                if hit is not None and isinstance(manager, FullAttentionManager):
                    del hit[length // size:]  # a prefix of a full-attention hit is a hit
                else:
                    hit = hits[group_id] = manager.find_longest_cache_hit(block_hashes, length)
                length = min(length, len(hit) * size)
            if length == start:
                break
        result = tuple(hit or [] for hit in hits)
        assert all(len(hit) * size == length for hit in result), "groups disagree on a hit"
        return result, length

    def allocate_slots(self, request: Request, num_tokens: int,
                       new_computed_blocks: GroupBlocks | None = None,
                       delay_cache_blocks: bool = False) -> GroupBlocks | None:
        """Cover `num_tokens` tokens of `request` in every group, taking `new_computed_blocks`
        (a prefix hit; only for a request that holds nothing yet). Returns the new blocks per
        group, or None, changing nothing, when the pool has too few free blocks.
        `delay_cache_blocks`: register nothing (blocks a KV connector is still loading:
        `cache_loaded_blocks` registers them once they hold their K/V)."""
        req_id, num_computed = request.request_id, request.num_computed_tokens
        hits = new_computed_blocks or self.empty_blocks()
        assert len(hits) == self.num_groups, f"{len(hits)} hit lists for {self.num_groups} groups"
        num_freed = sum(1 for m in self.managers
                        for b in m.get_skipped_blocks(req_id, num_computed) if b.ref_cnt == 1)
        num_needed = sum(m.get_num_blocks_to_allocate(req_id, num_tokens, hit)
                         for m, hit in zip(self.managers, hits, strict=True))
        if num_needed > self.pool.num_free_blocks + num_freed:
            return None
        for manager in self.managers:
            manager.remove_skipped_blocks(req_id, num_computed)
        for manager, hit in zip(self.managers, hits, strict=True):
            manager.save_new_computed_blocks(req_id, hit)
        new_blocks = tuple(m.allocate_new_blocks(req_id, num_tokens) for m in self.managers)
        if delay_cache_blocks:
            self.set_bounds(request)
        else:
            self.register_full_blocks(request, num_tokens)
        return new_blocks

    def set_bounds(self, request: Request) -> None:
        """Set what the request's blocks hold with nothing to allocate, in every
        (full-attention) group: `num_slot_tokens`, the tokens they have room for, and
        `num_covered_tokens`, the most tokens with none of them filling a block not registered
        yet — `allocate_slots` up to that many would change nothing (a decode inside its last
        block: most requests of most steps); up to `num_slot_tokens` it would only register
        (`register_full_blocks`). Both 0 where a sliding group's blocks change as the window
        moves. (Hashes may lag behind; whoever reads them extends them first.)"""
        slots = covered = 0
        if self._all_full:
            size, caching, req_id = self.block_size, self.pool.enable_caching, request.request_id
            for group_id, manager in enumerate(self.managers):
                blocks = manager.req_to_blocks.get(req_id)
                if blocks is None:
                    slots = covered = 0
                    break
                num = len(blocks) * size
                slots = num if group_id == 0 else min(slots, num)
                if caching:  # a token that fills block k needs the block registered
                    num = min(num, (manager.num_cached_blocks.get(req_id, 0) + 1) * size - 1)
                covered = num if group_id == 0 else min(covered, num)
        request.num_slot_tokens, request.num_covered_tokens = slots, covered

    def register_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the blocks the request's first `num_tokens` fill (prefix caching on), and
        set its bounds: the end of `allocate_slots`, and all of it where the blocks have room
        for `num_tokens` already (`num_slot_tokens`, no hit, nothing a connector loads)."""
        if self.pool.enable_caching:
            update_block_hashes(request, self.block_size)
            for manager in self.managers:
                manager.cache_blocks(request, num_tokens)
        self.set_bounds(request)

    def cache_loaded_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """A KV connector has loaded the request's blocks up to `num_computed_tokens`: null
        (and free) what the sliding groups no longer read — such a block may hold nothing its
        peer still had — then register the full blocks that remain."""
        for manager in self.managers:
            manager.remove_skipped_blocks(request.request_id, num_computed_tokens)
        self.register_full_blocks(request, num_computed_tokens)

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return tuple(m.get_block_ids(req_id) for m in self.managers)

    def free(self, req_id: str) -> None:
        """Release the request's blocks in every group (each tail first). Unknown: no-op."""
        for manager in self.managers:
            manager.free(req_id)

    def check_invariants(self) -> None:
        """Each manager's checks; every block's ref count equals its holders over all groups;
        a block is held, and cached, by one group only."""
        self.pool.check_invariants()
        holders: Counter[int] = Counter()
        group_of: dict[int, int] = {}
        req_ids = set(self.managers[0].req_to_blocks)
        for group_id, manager in enumerate(self.managers):
            manager.check_invariants()
            assert set(manager.req_to_blocks) == req_ids, f"group {group_id}: other requests"
            for blocks in manager.req_to_blocks.values():
                for block in blocks:
                    if block.is_null:
                        continue
                    holders[block.block_id] += 1
                    owner = group_of.setdefault(block.block_id, group_id)
                    assert owner == group_id, f"{block} held by groups {owner} and {group_id}"
                    if block.cache_key is not None:
                        cached_group = split_cache_key(block.cache_key)[1]
                        assert cached_group == group_id, (
                            f"{block} cached for group {cached_group}, held by {group_id}")
        for block in self.pool.blocks[1:]:
            assert block.ref_cnt == holders[block.block_id], (
                f"{block} is held by {holders[block.block_id]} requests")
