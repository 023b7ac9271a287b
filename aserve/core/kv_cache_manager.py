"""`KVCacheManager`: which blocks each request holds in each KV cache group, and prefix hits.

The scheduler's only door to the `BlockPool` and the `KVCacheCoordinator`. Per group, a
request's block list covers its tokens in order (a sliding group puts the null block, id 0,
where its window has passed):

    all_token_ids  [t0 ............ t15][t16 ........... t31][t32 t33 t34 -- -- ..]
    group 0 full   [block 7            ][block 2            ][block 9              ]
    group 1 W=8    [null               ][block 4            ][block 5              ]
    block_hashes    h0                   h1                    (not full: no hash)

A waiting request first asks `get_computed_blocks` for its longest cached prefix (the same
length in every group), then `allocate_slots` for the rest. Blocks are registered in the
prefix cache as soon as they are full of scheduled tokens, so a request scheduled later in the
same step can already hit them. `free` returns a request's blocks tail first; their cache keys
survive until the blocks are reused. With no groups given there is one full-attention group.
"""

from __future__ import annotations

from collections.abc import Sequence

from aserve.config import KVCacheGroupSpec
from aserve.core.block_pool import BlockPool
from aserve.core.hashing import update_block_hashes
from aserve.core.kv_cache_coordinator import GroupBlocks, KVCacheCoordinator
from aserve.core.request import Request


class KVCacheManager:
    """Blocks per request and group over one `BlockPool` of `num_blocks` blocks (block 0 the
    null block) of `block_size` tokens."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 kv_cache_groups: Sequence[KVCacheGroupSpec] = ()) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}.")
        groups = tuple(kv_cache_groups) or (KVCacheGroupSpec((), None, block_size),)
        for group in groups:
            if group.block_size != block_size:
                raise ValueError(f"KV cache group {group} has block size {group.block_size}, "
                                 f"not {block_size}.")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self.coordinator = KVCacheCoordinator(groups, self.block_pool)
        # What `allocate_slots` returns where a request's blocks hold the tokens already
        # (`Request.num_slot_tokens`; `num_covered_tokens`, which the scheduler checks for a
        # plain decode, where there is nothing to register either)
        self.no_new_blocks = self.coordinator.no_new_blocks
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def num_groups(self) -> int:
        return self.coordinator.num_groups

    @property
    def groups(self) -> tuple[KVCacheGroupSpec, ...]:
        return self.coordinator.groups

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """The longest cached prefix of the request in every group (its blocks per group, null
        blocks included), and the tokens it covers.

        At least one token is always left to compute (the model must produce logits for it).
        The blocks are not referenced here: pass them to `allocate_slots`, which takes them
        (and counts the lookup in the hit-rate stats, once per admission, not per retry).
        """
        if not self.enable_caching or not request.takes_prefix_hits:
            return self.coordinator.empty_blocks(), 0
        update_block_hashes(request, self.block_size)
        return self.coordinator.find_longest_cache_hit(request.block_hashes,
                                                       request.num_tokens - 1)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: GroupBlocks | None = None,
        num_external_tokens: int = 0,
    ) -> tuple[Sequence[int], ...] | None:
        """Grow the request's blocks in every group to cover its computed, newly cached and new
        tokens, first freeing the blocks its sliding groups no longer read.

        Returns the ids of the blocks allocated per group (not `new_computed_blocks`; where
        none is needed, one shared tuple of empty ones: read-only), or None,
        changing nothing, when too few blocks are free. A free block in `new_computed_blocks`
        leaves the free queue when taken, so it does not count as available for new blocks.
        `num_external_tokens`: tokens past the hit a KV connector will load into the new
        blocks (then `num_new_tokens` is 0, and nothing is registered in the prefix cache
        until `cache_loaded_blocks`).
        """
        num_tokens = (request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
                      + num_external_tokens)
        if new_computed_blocks is None and not num_external_tokens:
            if num_tokens <= request.num_covered_tokens:
                return self.coordinator.no_new_blocks  # nothing to do: no new block ids
            if num_tokens <= request.num_slot_tokens:  # room: only full blocks to register
                self.coordinator.register_full_blocks(request, num_tokens)
                return self.coordinator.no_new_blocks
        is_new = not self.coordinator.holds(request.request_id)
        new_blocks = self.coordinator.allocate_slots(request, num_tokens, new_computed_blocks,
                                                     delay_cache_blocks=num_external_tokens > 0)
        if new_blocks is None:
            return None
        if is_new:
            self._count_lookup(request, num_new_computed_tokens)
        return tuple([b.block_id for b in blocks] for blocks in new_blocks)

    def _count_lookup(self, request: Request, num_hit_tokens: int) -> None:
        if self.enable_caching and request.takes_prefix_hits:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def cache_loaded_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the blocks a KV connector loaded (see `KVCacheCoordinator`)."""
        self.coordinator.cache_loaded_blocks(request, num_computed_tokens)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Per group, the request's block ids in order (0, the null block, where skipped)."""
        return self.coordinator.get_block_ids(request_id)

    def holds_blocks(self, request_id: str) -> bool:
        """Whether the request has been allocated and not freed since."""
        return self.coordinator.holds(request_id)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, and forget it. Unknown requests: no-op."""
        self.coordinator.free(request.request_id)
        request.num_slot_tokens = request.num_covered_tokens = 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached key; refused (False) while any block is in use."""
        return self.block_pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Pool and per-group invariants; each block's ref count equals its holders over all
        groups (see `KVCacheCoordinator.check_invariants`)."""
        self.coordinator.check_invariants()
