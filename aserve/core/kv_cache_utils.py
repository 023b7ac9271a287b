"""KV cache groups: which layers share a block table, and how many blocks a request can need.

A model's layers are grouped by attention kind (full, or sliding with window W). With one kind
there is one group of every layer. With several, each kind is cut into groups of the same size
`group_size`, so that the runner keeps `group_size` KV buffers and buffer i serves layer i of
every group: a block id then belongs to one group at a time and a block is `group_size` layers'
worth of memory, whatever its group (docs/design.md §4).

    Gemma-2, 26 layers: even ones slide (W), odd ones are full
        group 0 (full):    layers 1 3 5 ... 25      buffers 0..12
        group 1 (sliding): layers 0 2 4 ... 24      buffers 0..12

`group_size` is the smallest kind's layer count, or the largest's when the counts are within
25% of each other (fewer, fuller groups); the last group of a kind may have fewer layers than
`group_size` (its unused buffers are the price of the uniform block).
"""

from __future__ import annotations

from collections.abc import Sequence

from aserve.config import KVCacheGroupSpec


def make_kv_cache_groups(layer_windows: Sequence[int | None], block_size: int
                         ) -> tuple[KVCacheGroupSpec, ...]:
    """The groups of a model whose layer i has sliding window `layer_windows[i]` (None: full
    attention). Full attention first, then windows from the shortest."""
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        by_window.setdefault(window, []).append(layer)
    if not by_window:
        return (KVCacheGroupSpec((), None, block_size),)
    kinds = sorted(by_window, key=lambda w: -1 if w is None else w)
    if len(kinds) == 1:
        return (KVCacheGroupSpec(tuple(by_window[kinds[0]]), kinds[0], block_size),)
    counts = [len(by_window[w]) for w in kinds]
    group_size = max(counts) if max(counts) < 1.25 * min(counts) else min(counts)
    groups = []
    for window in kinds:
        layers = by_window[window]
        num_groups = -(-len(layers) // group_size)
        for i in range(num_groups):
            groups.append(KVCacheGroupSpec(tuple(layers[i::num_groups]), window, block_size))
    return tuple(groups)


def max_blocks_per_request(group: KVCacheGroupSpec, max_model_len: int,
                           max_num_batched_tokens: int) -> int:
    """The most blocks of `group` one request holds at once.

    Full attention: its whole length. A sliding window W: the W - 1 tokens before a step's
    first query plus the step's tokens (at most the token budget), plus one block for a window
    that does not start on a block boundary; never more than the whole length needs.
    """
    bs = group.block_size
    whole = -(-max_model_len // bs)
    if group.sliding_window is None:
        return whole
    span = min(group.sliding_window - 1 + max_num_batched_tokens, max_model_len)
    return min(-(-span // bs) + 1, whole)


def blocks_per_request(groups: Sequence[KVCacheGroupSpec], max_model_len: int,
                       max_num_batched_tokens: int) -> int:
    """Blocks (over every group) one request of `max_model_len` tokens can hold at once."""
    return sum(max_blocks_per_request(g, max_model_len, max_num_batched_tokens) for g in groups)
