"""`KVCacheManager`: which blocks each request holds, and prefix-cache lookups by block hash.

The scheduler's only door to the `BlockPool`. A request's block list covers its tokens in order:

    all_token_ids  [t0 ............ t15][t16 ........... t31][t32 t33 t34 -- -- ..]
    blocks         [block 7            ][block 2            ][block 9              ]
    block_hashes    h0                   h1                    (not full: no hash)

A waiting request first asks `get_computed_blocks` for its longest cached prefix of full blocks,
then `allocate_slots` for the rest. Blocks are registered in the prefix cache as soon as they are
full of scheduled tokens, so a request scheduled later in the same step can already hit them.
`free` returns a request's blocks tail first; their hashes survive until the blocks are reused.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from aserve.core.block_pool import BlockPool, KVCacheBlock
from aserve.core.hashing import update_block_hashes
from aserve.core.request import Request


class KVCacheManager:
    """Blocks per request over one `BlockPool` of `num_blocks` blocks of `block_size` tokens."""

    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}.")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # per request: blocks already registered
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request's full blocks, and the tokens it covers.

        At least one token is always left to compute (the model must produce logits for it).
        The blocks are not referenced here: pass them to `allocate_slots`, which takes them
        (and counts the lookup in the hit-rate stats, once per admission, not per retry).
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        update_block_hashes(request, self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> list[int] | None:
        """Grow the request's blocks to cover its computed, newly cached and new tokens.

        Returns the ids of the blocks allocated (not `new_computed_blocks`), or None, changing
        nothing, when too few blocks are free. A free block in `new_computed_blocks` leaves the
        free queue when taken, so it does not count as available for the new blocks.
        """
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        held = self.req_to_blocks.get(request.request_id, [])
        num_needed = -(-num_tokens // self.block_size)
        num_new_blocks = max(0, num_needed - len(held) - len(new_computed_blocks))
        num_evictable_computed = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.num_free_blocks - num_evictable_computed:
            return None
        if request.request_id not in self.req_to_blocks:
            self._count_lookup(request, num_new_computed_tokens)
        self.block_pool.touch(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        blocks.extend(new_computed_blocks)
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, num_tokens)
        return [b.block_id for b in new_blocks]

    def _count_lookup(self, request: Request, num_hit_tokens: int) -> None:
        if self.enable_caching and request.sampling_params.prompt_logprobs is None:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock],
                           num_tokens: int) -> None:
        update_block_hashes(request, self.block_size)
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        num_cached = self.num_cached_blocks.get(request.request_id, 0)
        if num_full > num_cached:
            self.block_pool.cache_full_blocks(blocks, request.block_hashes, num_cached, num_full)
            self.num_cached_blocks[request.request_id] = num_full

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, and forget it. Unknown requests: no-op."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        return self.block_pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Pool invariants, and each block's ref count equals the number of requests holding it."""
        self.block_pool.check_invariants()
        holders: Counter[int] = Counter()
        for req_id, blocks in self.req_to_blocks.items():
            ids = [b.block_id for b in blocks]
            assert len(set(ids)) == len(ids), f"request {req_id} holds a block twice: {ids}"
            assert self.num_cached_blocks.get(req_id, 0) <= len(blocks), (
                f"request {req_id} registered more blocks than it holds")
            holders.update(ids)
        for block in self.block_pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (
                f"{block} is held by {holders[block.block_id]} requests")
