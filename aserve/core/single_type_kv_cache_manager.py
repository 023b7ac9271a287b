"""Per-group block lists: one `SingleTypeKVCacheManager` per KV cache group, over a shared pool.

A group's manager keeps, for each request, the list of blocks covering its tokens in order,
and how many of them are registered in the prefix cache. Two kinds:

`FullAttentionManager`: every earlier key is read, so a request holds every block of its
tokens, and a prefix hit is the longest run of cached blocks from block 0.

`SlidingWindowManager(W)`: a query at position p reads keys [p - W + 1, p] only. A block
wholly before the window of the first query still to compute is never read again: it is
replaced by the null block in the request's list and freed (keeping its cache key, so it
stays a prefix hit until evicted). W = 6, block_size 4, num_computed_tokens 13:

    positions   0..3    4..7    8..11   12..15
    blocks     [null ] [ b4  ] [ b9  ] [ b2  ]      window of position 13: [8, 13]
                 ▲ freed: wholly before 13 - 6 + 1 = 8   (b4 goes next, at num_computed 16)

A sliding hit of length L needs only the ceil((W - 1) / block_size) blocks ending at L cached
(the window of position L); the blocks to their left are the null block:

    cached?      no   yes   no   yes  yes           W = 9, block_size 4: 2 blocks needed
    hit          [null][null][null][ b3][ b8]       scanned right to left; L = 20

A run of cached blocks reaching block 0 is a hit even when shorter than that.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from aserve.config import KVCacheGroupSpec
from aserve.core.block_pool import BlockPool, KVCacheBlock
from aserve.core.request import Request


class SingleTypeKVCacheManager(ABC):
    """The blocks of one KV cache group (`group_id`) per request, over the shared `pool`.

    Contract (the coordinator calls these in this order for one allocation):

    - `find_longest_cache_hit(block_hashes, max_length)`: the blocks of the longest prefix of
      at most `max_length` tokens (a multiple of the block size) this group can reuse, null
      blocks included; takes no reference. Its length times `block_size` is the hit length.
    - `get_skipped_blocks(req_id, num_computed_tokens)`: the held blocks that
      `remove_skipped_blocks` would free (none for full attention). Pure.
    - `get_num_blocks_to_allocate(req_id, num_tokens, new_computed_blocks)`: free blocks this
      group needs to cover `num_tokens` (after skipped blocks are removed): new blocks plus
      hit blocks that are free now (touching them takes them out of the free queue).
    - `remove_skipped_blocks(req_id, num_computed_tokens)`: free the blocks no query from
      `num_computed_tokens` on reads, putting the null block in their place.
    - `save_new_computed_blocks(req_id, new_computed_blocks)`: take and append the hit.
    - `allocate_new_blocks(req_id, num_tokens)`: append fresh blocks up to `num_tokens`.
    - `cache_blocks(request, num_tokens)`: register the full blocks of the first
      `num_tokens` tokens not registered yet (never the null block).
    - `free(req_id)`: release every block, tail first, and forget the request.
    """

    def __init__(self, pool: BlockPool, block_size: int, group_id: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.group_id = group_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # per request: blocks already registered

    @abstractmethod
    def find_longest_cache_hit(self, block_hashes: Sequence[bytes],
                               max_length: int) -> list[KVCacheBlock]:
        """This group's longest hit of at most `max_length` tokens (see the class docstring)."""

    def get_skipped_blocks(self, req_id: str, num_computed_tokens: int) -> list[KVCacheBlock]:
        return []

    def remove_skipped_blocks(self, req_id: str, num_computed_tokens: int) -> None:
        return None

    def get_num_blocks_to_allocate(self, req_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock]) -> int:
        held = len(self.req_to_blocks.get(req_id, ()))
        num_new = max(0, -(-num_tokens // self.block_size) - held - len(new_computed_blocks))
        num_evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return num_new + num_evictable

    def save_new_computed_blocks(self, req_id: str,
                                 new_computed_blocks: Sequence[KVCacheBlock]) -> None:
        blocks = self.req_to_blocks.setdefault(req_id, [])
        if new_computed_blocks:
            assert not blocks, f"{req_id}: a prefix hit for a request that holds blocks"
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)

    def allocate_new_blocks(self, req_id: str, num_tokens: int) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks.setdefault(req_id, [])
        num_new = max(0, -(-num_tokens // self.block_size) - len(blocks))
        new_blocks = self.pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """`request.block_hashes` must already cover its full blocks."""
        req_id = request.request_id
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        num_cached = self.num_cached_blocks.get(req_id, 0)
        if num_full > num_cached:
            self.pool.cache_full_blocks(self.req_to_blocks[req_id], request.block_hashes,
                                        num_cached, num_full, self.group_id)
            self.num_cached_blocks[req_id] = num_full

    def free(self, req_id: str) -> None:
        blocks = self.req_to_blocks.pop(req_id, None)
        self.num_cached_blocks.pop(req_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))  # the null block is skipped

    def get_block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(req_id, ())]

    def check_invariants(self) -> None:
        """No request holds a non-null block twice or registered more blocks than it holds."""
        for req_id, blocks in self.req_to_blocks.items():
            ids = [b.block_id for b in blocks if not b.is_null]
            assert len(set(ids)) == len(ids), (
                f"group {self.group_id}: request {req_id} holds a block twice: {ids}")
            assert self.num_cached_blocks.get(req_id, 0) <= len(blocks), (
                f"group {self.group_id}: request {req_id} registered more blocks than it holds")


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention: every block is kept; a hit is the cached run from block 0."""

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes],
                               max_length: int) -> list[KVCacheBlock]:
        hit = []
        for block_hash in block_hashes[:max_length // self.block_size]:
            block = self.pool.get_cached_block(block_hash, self.group_id)
            if block is None:
                break
            hit.append(block)
        return hit

    def check_invariants(self) -> None:
        super().check_invariants()
        for req_id, blocks in self.req_to_blocks.items():
            assert not any(b.is_null for b in blocks), (
                f"group {self.group_id}: full-attention request {req_id} holds the null block")


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding window `window`: blocks behind the window are nulled and freed (module doc)."""

    def __init__(self, pool: BlockPool, block_size: int, group_id: int, window: int) -> None:
        super().__init__(pool, block_size, group_id)
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}.")
        self.window = window
        # Blocks ending at a hit's length that must be cached: the window of its first query.
        self.num_hit_blocks_needed = -(-(window - 1) // block_size)
        # Per request: num_computed_tokens of the last `remove_skipped_blocks` (for the checks).
        self.num_computed_at_skip: dict[str, int] = {}

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes],
                               max_length: int) -> list[KVCacheBlock]:
        num_blocks = min(max_length // self.block_size, len(block_hashes))
        hit = [self.pool.null_block] * num_blocks
        run = 0  # consecutive cached blocks ending at index + run
        for index in range(num_blocks - 1, -1, -1):
            block = self.pool.get_cached_block(block_hashes[index], self.group_id)
            if block is None:
                run = 0
                continue
            hit[index] = block
            run += 1
            if run >= self.num_hit_blocks_needed:
                return hit[:index + run]
        return hit[:run]  # a run from block 0, shorter than needed, is still a hit

    def _num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Blocks wholly before the window of position `num_computed_tokens`."""
        return max(0, num_computed_tokens - self.window + 1) // self.block_size

    def get_skipped_blocks(self, req_id: str, num_computed_tokens: int) -> list[KVCacheBlock]:
        """The held non-null blocks behind the window, last first (vLLM frees them so)."""
        blocks = self.req_to_blocks.get(req_id, [])
        skipped = []
        for index in range(min(self._num_skipped_blocks(num_computed_tokens), len(blocks)) - 1,
                           -1, -1):
            if blocks[index].is_null:
                break  # everything to its left was nulled before
            skipped.append(blocks[index])
        return skipped

    def remove_skipped_blocks(self, req_id: str, num_computed_tokens: int) -> None:
        skipped = self.get_skipped_blocks(req_id, num_computed_tokens)
        self.num_computed_at_skip[req_id] = num_computed_tokens
        if not skipped:
            return
        blocks = self.req_to_blocks[req_id]
        end = min(self._num_skipped_blocks(num_computed_tokens), len(blocks))
        for index in range(end - len(skipped), end):
            blocks[index] = self.pool.null_block
        self.pool.free_blocks(skipped)

    def free(self, req_id: str) -> None:
        super().free(req_id)
        self.num_computed_at_skip.pop(req_id, None)

    def check_invariants(self) -> None:
        """Also: no non-null block wholly before the window of the last skip, and once a
        block is null every block to its left is null too."""
        super().check_invariants()
        for req_id, blocks in self.req_to_blocks.items():
            num_computed = self.num_computed_at_skip.get(req_id, 0)
            end = min(self._num_skipped_blocks(num_computed), len(blocks))
            assert all(b.is_null for b in blocks[:end]), (
                f"group {self.group_id}: {req_id} holds a block behind its window "
                f"(num_computed {num_computed}): {[b.block_id for b in blocks]}")
            num_null = sum(b.is_null for b in blocks)
            assert all(b.is_null for b in blocks[:num_null]), (
                f"group {self.group_id}: {req_id} holds a null block inside its window: "
                f"{[b.block_id for b in blocks]}")


def make_single_type_manager(group: KVCacheGroupSpec, pool: BlockPool,
                             group_id: int) -> SingleTypeKVCacheManager:
    if group.sliding_window is None:
        return FullAttentionManager(pool, group.block_size, group_id)
    return SlidingWindowManager(pool, group.block_size, group_id, group.sliding_window)
