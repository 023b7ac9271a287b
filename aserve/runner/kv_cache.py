"""KV-cache tensors: allocated once, one per attention layer, sized in blocks.

    kv_cache[layer]  [2, num_blocks, block_size, num_kv_heads, head_dim]
                      └ 0: keys, 1: values
"""

from __future__ import annotations

import torch


def kv_cache_bytes_per_block(arch, block_size: int, num_layers: int, num_kv_heads: int) -> int:
    """Bytes one block takes over `num_layers` layers (keys and values) on a rank holding
    `num_kv_heads` kv heads (all layers and heads without pipeline / tensor parallelism)."""
    itemsize = torch.empty((), dtype=arch.dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * arch.head_dim * itemsize


def allocate_kv_caches(arch, num_blocks: int, block_size: int, num_layers: int,
                       num_kv_heads: int, device: torch.device) -> list[torch.Tensor]:
    shape = (2, num_blocks, block_size, num_kv_heads, arch.head_dim)
    return [torch.zeros(shape, dtype=arch.dtype, device=device) for _ in range(num_layers)]
