"""Write the new tokens' keys and values into the paged KV cache: Triton kernel and torch twin.

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

Each slot row holds `[num_kv_heads, head_dim]`. `store_kv_triton` (CUDA/ROCm) is one program per
token that copies its `[Hkv, D]` rows, converting to the cache dtype; `store_kv_ref` is its
torch twin and oracle.
"""

from __future__ import annotations

import torch

from aserve.kernels.triton_utils import check_float, next_pow2, require_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the module still imports; store_kv_triton says what is missing
    triton = None

if triton is not None:

    @triton.jit
    def _store_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, block_size,
                         stride_kt, stride_kh, stride_vt, stride_vh, stride_kcb, stride_kcs,
                         stride_kch, stride_vcb, stride_vcs, stride_vch, NUM_HEADS: tl.constexpr,
                         HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot < 0:
            return  # padding
        heads, dims = tl.arange(0, H_PAD), tl.arange(0, D_PAD)
        mask = (heads[:, None] < NUM_HEADS) & (dims[None, :] < HEAD_DIM)  # [H_PAD, D_PAD]
        block, off = slot // block_size, slot % block_size
        k = tl.load(key_ptr + t * stride_kt + heads[:, None] * stride_kh + dims[None, :],
                    mask=mask)
        v = tl.load(value_ptr + t * stride_vt + heads[:, None] * stride_vh + dims[None, :],
                    mask=mask)
        k_dst = k_cache_ptr + block * stride_kcb + off * stride_kcs + heads[:, None] * stride_kch
        v_dst = v_cache_ptr + block * stride_vcb + off * stride_vcs + heads[:, None] * stride_vch
        tl.store(k_dst + dims[None, :], k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst + dims[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)
else:  # no triton: the launchers raise require_triton's RuntimeError
    _store_kv_kernel = None


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


def store_kv_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """`store_kv_ref` in Triton: the same shapes; key/value rows may be strided (split from a
    fused qkv projection) but each head's `head_dim` values must be contiguous."""
    require_triton("store_kv_triton", _store_kv_kernel, key, value, k_cache, v_cache,
                   slot_mapping)
    _check_shapes(key, value, k_cache, v_cache, slot_mapping)
    check_float("store_kv_triton", key=key, value=value, k_cache=k_cache, v_cache=v_cache)
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"store_kv_triton: slot_mapping must be int32/int64, "
                         f"got {slot_mapping.dtype}.")
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping.contiguous(), k_cache.shape[1],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), *k_cache.stride()[:3],
        *v_cache.stride()[:3], NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        H_PAD=next_pow2(num_heads), D_PAD=next_pow2(head_dim))
