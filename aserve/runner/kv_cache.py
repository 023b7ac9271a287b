"""KV-cache tensors: allocated once, sized in blocks, shared by the KV cache groups.

    kv_buffer[i]  [2, num_blocks, block_size, num_kv_heads, head_dim]
                   └ 0: keys, 1: values

Buffer i serves the i-th layer of every KV cache group (`aserve/core/kv_cache_utils.py`): a
block id belongs to one group at a time, so block b of buffer i holds the K/V of exactly one
layer. One group (a model without sliding windows) is one buffer per layer, as before.

    groups   full: layers 1 3 5        sliding: layers 0 2 4
    buffers  0: layers 1, 0     1: layers 3, 2     2: layers 5, 4

Under pipeline parallelism a stage allocates only the buffers its own layers use.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from aserve.config import KVCacheGroupSpec


def layer_placement(groups: Sequence[KVCacheGroupSpec]) -> dict[int, tuple[int, int]]:
    """Model layer -> (its group, its KV buffer)."""
    return {layer: (g, i) for g, group in enumerate(groups)
            for i, layer in enumerate(group.layers)}


def kv_buffer_ids(groups: Sequence[KVCacheGroupSpec], layers: Iterable[int]) -> list[int]:
    """The buffers the given model layers use, in order."""
    placement = layer_placement(groups)
    missing = [layer for layer in layers if layer not in placement]
    if missing:
        raise ValueError(f"layers {missing} are in no KV cache group.")
    return sorted({placement[layer][1] for layer in layers})


def kv_cache_bytes_per_block(arch, block_size: int, num_buffers: int, num_kv_heads: int) -> int:
    """Bytes one block takes over `num_buffers` buffers (keys and values) on a rank holding
    `num_kv_heads` kv heads."""
    itemsize = torch.empty((), dtype=arch.dtype).element_size()
    return 2 * num_buffers * block_size * num_kv_heads * arch.head_dim * itemsize


def allocate_kv_buffers(arch, num_blocks: int, block_size: int, buffer_ids: Sequence[int],
                        num_kv_heads: int, device: torch.device) -> dict[int, torch.Tensor]:
    shape = (2, num_blocks, block_size, num_kv_heads, arch.head_dim)
    return {i: torch.zeros(shape, dtype=arch.dtype, device=device) for i in buffer_ids}
