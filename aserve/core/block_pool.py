"""`BlockPool`: every KV-cache block, its reference count, the free queue and the prefix cache.

Pure bookkeeping over block ids; the KV tensors themselves live in the runner. A block with
ref_cnt 0 sits in the free queue. A free block may still carry a cache key: it stays in the
prefix cache, reusable by a later hit, until it is popped for a new allocation (then it is
evicted). One pool serves every KV cache group; a block belongs to one group at a time, so the
prefix cache is keyed by (block hash, group id): `make_cache_key`.

Block 0 is the null block, for every model: it stands for a skipped slot in a sliding-window
group's block list (a block wholly before the window, freed or never held). It is never in the
free queue, never freed, never cached, and its ref count stays 0; `num_free_blocks` and `usage`
count the other `num_blocks - 1` blocks only.

    blocks   [null][b1][b2][b3] ... [b(n-1)]
              ▲     └── the free queue starts with these, in id order
              never handed out

The free queue is an intrusive doubly-linked list threaded through the blocks themselves, so
removing a block from its middle (a prefix hit on a free block) is O(1):

    head ⇄ [b7] ⇄ [b2] ⇄ [b5] ⇄ ... ⇄ [b3] ⇄ tail        (head and tail are sentinels)
            ▲                           ▲
            popleft(): reused first,   append(): the block freed most recently
            the least recently freed

Eviction order is therefore LRU by time of freeing. A request frees its blocks tail first, so
its prefix's first blocks (the ones most worth keeping) are evicted last.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class KVCacheBlock:
    """One block: its id, how many requests hold it, its hash once full and cached."""

    __slots__ = ("block_id", "ref_cnt", "cache_key", "is_null", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # (hash, group) as `make_cache_key` packs it: set once when cached, cleared on eviction
        self.cache_key: bytes | None = None
        self.is_null = False
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    @property
    def block_hash(self) -> bytes | None:
        """The block hash part of `cache_key` (None when not cached)."""
        return None if self.cache_key is None else split_cache_key(self.cache_key)[0]

    def __repr__(self) -> str:
        if self.is_null:
            return "KVCacheBlock(null)"
        key = None
        if self.cache_key is not None:
            block_hash, group_id = split_cache_key(self.cache_key)
            key = f"{block_hash.hex()[:8]}/g{group_id}"
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, key={key})"


_GROUP_BYTES = 4


def make_cache_key(block_hash: bytes, group_id: int) -> bytes:
    """The prefix-cache key of a block of group `group_id` whose tokens hash to `block_hash`."""
    return block_hash + group_id.to_bytes(_GROUP_BYTES, "little")


def split_cache_key(cache_key: bytes) -> tuple[bytes, int]:
    """(block hash, group id) of a key made by `make_cache_key`."""
    return cache_key[:-_GROUP_BYTES], int.from_bytes(cache_key[-_GROUP_BYTES:], "little")


class FreeBlockQueue:
    """Intrusive doubly-linked list of free blocks: O(1) `popleft`, `remove` and `append`."""

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free
        if block is self.tail or block is None:
            raise ValueError("No free blocks left.")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue.")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self.tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self.tail
        self.tail.prev_free = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks from head (evicted first) to tail. O(n): for tests and checks."""
        blocks = []
        block = self.head.next_free
        while block is not None and block is not self.tail:
            blocks.append(block)
            block = block.next_free
        return blocks


class BlockPool:
    """All blocks, the null block, the free queue, and the prefix cache `cached_blocks`
    (cache key → block)."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (block 0 is the null block), "
                             f"got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can be handed out: all but the null block."""
        return self.num_blocks - 1

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by some request (free cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` from the head of the free queue, evicting their keys; ref_cnt 1."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"Cannot get {num_blocks} blocks: only {self.num_free_blocks} free.")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        if block.cache_key is not None:
            del self.cached_blocks[block.cache_key]
            block.cache_key = None

    def get_cached_block(self, block_hash: bytes, group_id: int = 0) -> KVCacheBlock | None:
        return self.cached_blocks.get(make_cache_key(block_hash, group_id))

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix hit); a free one leaves the queue.
        The null block is skipped."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; those reaching 0 join the queue's tail in order.
        The null block is skipped."""
        for block in ordered_blocks:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise ValueError(f"{block} freed more often than it was taken.")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[bytes],
        num_cached_blocks: int,
        num_full_blocks: int,
        group_id: int = 0,
    ) -> None:
        """Register `blocks[num_cached_blocks:num_full_blocks]` of group `group_id`.

        A block that already carries its key (it came from a prefix hit) is left as it is; a
        block whose key another block already holds is not registered (the first one wins);
        the null block (a skipped slot) is never registered.
        """
        if not self.enable_caching:
            return
        for index in range(num_cached_blocks, num_full_blocks):
            block = blocks[index]
            if block.is_null:
                continue
            key = make_cache_key(block_hashes[index], group_id)
            if block.cache_key is not None:
                assert block.cache_key == key, f"{block} re-cached under another key"
            elif key not in self.cached_blocks:
                block.cache_key = key
                self.cached_blocks[key] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached key, only when no block is in use. Returns whether it did."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.cached_blocks.values():
            block.cache_key = None
        self.cached_blocks.clear()
        return True

    def check_invariants(self) -> None:
        """Raise AssertionError if the queue, the ref counts, the null block or the cache map
        disagree."""
        self._check_free_queue()
        null = self.null_block
        assert null is self.blocks[0] and null.is_null, "block 0 is not the null block"
        assert null.ref_cnt == 0 and null.cache_key is None, f"null block touched: {null!r}"
        assert not any(b.is_null for b in self.blocks[1:]), "a second null block"
        for cache_key, block in self.cached_blocks.items():
            assert block.cache_key == cache_key, f"cache map entry points to {block}"
        hashed = [b for b in self.blocks if b.cache_key is not None]
        assert len(hashed) == len(self.cached_blocks), "a cached block is missing from the map"

    def _check_free_queue(self) -> None:
        queue = self.free_queue
        free_ids, prev = [], queue.head
        block = queue.head.next_free
        while block is not queue.tail:
            assert block is not None, "free queue broken: a next link is None"
            assert block.prev_free is prev, f"free queue broken: bad prev link at {block}"
            assert len(free_ids) < self.num_blocks, "free queue has a cycle"
            free_ids.append(block.block_id)
            prev, block = block, block.next_free
        assert queue.tail.prev_free is prev, "free queue broken: bad tail link"
        assert len(free_ids) == queue.num_free_blocks, (
            f"free queue holds {len(free_ids)} blocks, counts {queue.num_free_blocks}")
        for i, b in enumerate(self.blocks):
            assert b.block_id == i, f"blocks[{i}] has id {b.block_id}"
            assert b.ref_cnt >= 0, f"{b} has a negative ref count"
        assert 0 not in free_ids, "the null block is in the free queue"
        zero_ref = sorted(b.block_id for b in self.blocks[1:] if b.ref_cnt == 0)
        assert sorted(free_ids) == zero_ref, (
            f"free queue {sorted(free_ids)} != ref-0 blocks {zero_ref}")
