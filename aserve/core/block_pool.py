"""`BlockPool`: every KV-cache block, its reference count, the free queue and the prefix cache.

Pure bookkeeping over block ids; the KV tensors themselves live in the runner. A block with
ref_cnt 0 sits in the free queue. A free block may still carry a hash: it stays in the prefix
cache, reusable by a later hit, until it is popped for a new allocation (then it is evicted).

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

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None  # set once when cached; cleared only on eviction
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        hash_hex = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={hash_hex})"


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
    """All blocks, the free queue, and the prefix cache `cached_blocks` (hash → block)."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by some request (free but cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` from the head of the free queue, evicting their hashes; ref_cnt 1."""
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
        if block.block_hash is not None:
            del self.cached_blocks[block.block_hash]
            block.block_hash = None

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix hit); a free one leaves the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; those reaching 0 join the queue's tail in order."""
        for block in ordered_blocks:
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
    ) -> None:
        """Register `blocks[num_cached_blocks:num_full_blocks]` under their hashes.

        A block that already carries its hash (it came from a prefix hit) is left as it is; a
        block whose hash another block already holds is not registered (the first one wins).
        """
        if not self.enable_caching:
            return
        for index in range(num_cached_blocks, num_full_blocks):
            block, block_hash = blocks[index], block_hashes[index]
            if block.block_hash is not None:
                assert block.block_hash == block_hash, f"{block} re-cached under another hash"
            elif block_hash not in self.cached_blocks:
                block.block_hash = block_hash
                self.cached_blocks[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, only when no block is in use. Returns whether it did."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        return True

    def check_invariants(self) -> None:
        """Raise AssertionError if the queue, the ref counts or the cache map disagree."""
        self._check_free_queue()
        for block_hash, block in self.cached_blocks.items():
            assert block.block_hash == block_hash, f"cache map entry points to {block}"
        hashed = [b for b in self.blocks if b.block_hash is not None]
        assert len(hashed) == len(self.cached_blocks), "a hashed block is missing from the map"

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
        zero_ref = sorted(b.block_id for b in self.blocks if b.ref_cnt == 0)
        assert sorted(free_ids) == zero_ref, (
            f"free queue {sorted(free_ids)} != ref-0 blocks {zero_ref}")
