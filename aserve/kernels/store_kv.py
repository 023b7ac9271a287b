"""Write the new tokens' keys and values into the paged KV cache (torch reference twin).

The cache of one layer is one tensor `kv_cache` of shape
`[2, num_blocks, block_size, num_kv_heads, head_dim]`; `k_cache = kv_cache[0]`,
`v_cache = kv_cache[1]`. A slot names one token's row: `slot = block_id * block_size + offset`.

```
k_cache (block_size = 4)            slot_mapping = [9, 10, -1, 2]
          offset: 0   1   2   3
  block 0      [  0 | 1 | 2 | 3 ]   token 3 -> slot 2  (block 0, offset 2)
  block 1      [  4 | 5 | 6 | 7 ]
  block 2      [  8 | 9 |10 |11 ]   token 0 -> slot 9, token 1 -> slot 10
                                    token 2 -> -1: padding, not written
```

Each slot row holds `[num_kv_heads, head_dim]`. This module imports only torch.
"""

from __future__ import annotations

import torch


def _check_shapes(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    if key.shape != value.shape or key.dim() != 3:
        raise ValueError(f"key/value must both be [T, Hkv, D], got {key.shape} and {value.shape}.")
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError(f"k/v caches must both be [NB, BS, Hkv, D], got {k_cache.shape}.")
    if k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"cache rows {k_cache.shape[2:]} do not match key rows {key.shape[1:]}.")
    if slot_mapping.shape != key.shape[:1]:
        raise ValueError(f"slot_mapping must be [T={key.shape[0]}], got {slot_mapping.shape}.")


def store_kv_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Copy `key[t]`, `value[t]` into slot `slot_mapping[t]` of the caches; skip slots < 0.

    key, value: [T, Hkv, D]; k_cache, v_cache: [NB, BS, Hkv, D] (views that share storage with the
    layer's cache: the write is in place); slot_mapping: [T] int64.
    """
    _check_shapes(key, value, k_cache, v_cache, slot_mapping)
    k_rows = k_cache.view(-1, *k_cache.shape[2:])  # [NB * BS, Hkv, D], a view: writes land in place
    v_rows = v_cache.view(-1, *v_cache.shape[2:])  # [NB * BS, Hkv, D]
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.long)  # [T]
    valid = slots >= 0  # [T]
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[valid], value[valid]
    k_rows.index_copy_(0, slots, key.to(k_rows.dtype))
    v_rows.index_copy_(0, slots, value.to(v_rows.dtype))
