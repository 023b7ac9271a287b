"""Rotary position embedding (neox / rotate-half style), in place on q and k: `rotary_triton`
(CUDA/ROCm, one program per token over all its q and k heads) and its torch twin and oracle
`rotary_ref`, which is `rope_ref` on each tensor.

```
x = [x1 | x2 | pass]        x1, x2: rotary_dim / 2 each; pass: head_dim - rotary_dim, untouched
out = [x1*cos1 - x2*sin1 | x2*cos2 + x1*sin2 | pass]     cos = [cos1 | cos2] = cos_cache[pos]
```

Products and the sum round to the promoted dtype of x and cos/sin, as torch does.
The frequencies and the caches are built in `aserve/layers/rotary.py`; the C++ CPU version of
the same op lives in `cpu_elementwise`.
"""

from __future__ import annotations

import torch

from aserve.kernels.triton_utils import check_float, next_pow2, require_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the module still imports; rotary_triton says what is missing
    triton = None

if triton is not None:
    _TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16,
                  torch.bfloat16: tl.bfloat16}

    @triton.jit
    def _rotate_heads(x_ptr, row, c1, c2, s1, s2, NUM_HEADS: tl.constexpr,
                      HEAD_DIM: tl.constexpr, HALF: tl.constexpr, H_PAD: tl.constexpr,
                      HALF_PAD: tl.constexpr, COMPUTE: tl.constexpr):
        """Rotate the NUM_HEADS heads of one token row in place; c/s: [1, HALF_PAD] float32."""
        heads, cols = tl.arange(0, H_PAD), tl.arange(0, HALF_PAD)
        mask = (heads[:, None] < NUM_HEADS) & (cols[None, :] < HALF)  # [H_PAD, HALF_PAD]
        first = x_ptr + row + heads[:, None] * HEAD_DIM + cols[None, :]
        x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
        o1 = (x1 * c1).to(COMPUTE).to(tl.float32) + (-x2 * s1).to(COMPUTE).to(tl.float32)
        o2 = (x2 * c2).to(COMPUTE).to(tl.float32) + (x1 * s2).to(COMPUTE).to(tl.float32)
        out_dtype = x_ptr.dtype.element_ty
        tl.store(first, o1.to(COMPUTE).to(out_dtype), mask=mask)
        tl.store(first + HALF, o2.to(COMPUTE).to(out_dtype), mask=mask)

    @triton.jit
    def _rotary_kernel(pos_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr, stride_q, stride_k, stride_cos,
                       stride_sin, Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr,
                       HEAD_DIM: tl.constexpr, HALF: tl.constexpr, QH_PAD: tl.constexpr,
                       KH_PAD: tl.constexpr, HALF_PAD: tl.constexpr, Q_COMPUTE: tl.constexpr,
                       K_COMPUTE: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        cols = tl.arange(0, HALF_PAD)[None, :]  # [1, HALF_PAD]
        ok = cols < HALF
        c1 = tl.load(cos_ptr + pos * stride_cos + cols, mask=ok, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + pos * stride_cos + HALF + cols, mask=ok, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + pos * stride_sin + cols, mask=ok, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + pos * stride_sin + HALF + cols, mask=ok, other=0.0).to(tl.float32)
        _rotate_heads(q_ptr, t * stride_q, c1, c2, s1, s2, Q_HEADS, HEAD_DIM, HALF, QH_PAD,
                      HALF_PAD, Q_COMPUTE)
        if K_HEADS > 0:
            _rotate_heads(k_ptr, t * stride_k, c1, c2, s1, s2, K_HEADS, HEAD_DIM, HALF, KH_PAD,
                          HALF_PAD, K_COMPUTE)
else:  # no triton: the launchers raise require_triton's RuntimeError
    _rotary_kernel = None


def rope_ref(positions: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             head_dim: int, rotary_dim: int) -> None:
    """In place on x [T, H * head_dim] or [T, H, head_dim] (rows may be strided)."""
    rows = x.view(x.shape[0], -1, head_dim)[..., :rotary_dim]  # [T, H, rot], a view of x
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [T, 1, rot]
    x1, x2 = rows.chunk(2, dim=-1)
    rows.copy_(rows * c + torch.cat((-x2, x1), dim=-1) * s)


def rotary_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor | None,
               cos: torch.Tensor, sin: torch.Tensor, head_dim: int, rotary_dim: int) -> None:
    """In place: `rope_ref` on q and on k (when given)."""
    rope_ref(positions, q, cos, sin, head_dim, rotary_dim)
    if k is not None:
        rope_ref(positions, k, cos, sin, head_dim, rotary_dim)


def _num_heads(name: str, x: torch.Tensor, num_tokens: int, head_dim: int) -> int:
    """Heads per token row of x ([T, H * D] or [T, H, D], heads contiguous within a row)."""
    width = x[0].numel() if num_tokens else x.shape[1:].numel()
    dense = x.dim() == 2 or (x.dim() == 3 and x.shape[2] == head_dim and x.stride(1) == head_dim)
    if x.shape[0] != num_tokens or width % head_dim or not dense or x.stride(-1) != 1:
        raise ValueError(f"rotary_triton: {name} must be [T={num_tokens}, H * {head_dim}] or "
                         f"[T, H, {head_dim}] with contiguous rows, got {tuple(x.shape)} "
                         f"strides {x.stride()}.")
    return width // head_dim


def rotary_triton(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor | None,
                  cos: torch.Tensor, sin: torch.Tensor, head_dim: int, rotary_dim: int) -> None:
    """`rotary_ref` in Triton, in place. positions [T] int; q [T, Hq * D] / [T, Hq, D] and k
    alike (rows may be strided, e.g. split from a fused qkv); cos, sin [max_pos, rotary_dim]."""
    tensors = (positions, q, cos, sin) if k is None else (positions, q, k, cos, sin)
    require_triton("rotary_triton", _rotary_kernel, *tensors)
    num_tokens = positions.shape[0]
    q_heads = _num_heads("q", q, num_tokens, head_dim)
    k_heads = 0 if k is None else _num_heads("k", k, num_tokens, head_dim)
    if cos.dim() != 2 or cos.shape[1] != rotary_dim or sin.shape != cos.shape or (
            rotary_dim % 2 or rotary_dim > head_dim):
        raise ValueError(f"rotary_triton: cos/sin must be [max_pos, rotary_dim={rotary_dim}] "
                         f"(even, <= head_dim), got {tuple(cos.shape)}, {tuple(sin.shape)}.")
    if positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rotary_triton: positions must be [T] int32/int64, got "
                         f"{positions.dtype} {tuple(positions.shape)}.")
    check_float("rotary_triton", q=q, cos=cos, sin=sin, **({} if k is None else {"k": k}))
    if num_tokens == 0:
        return
    k = q if k is None else k
    q_compute, k_compute = (torch.promote_types(x.dtype, cos.dtype) for x in (q, k))
    _rotary_kernel[(num_tokens,)](
        positions.contiguous(), q, k, cos, sin, q.stride(0), k.stride(0), cos.stride(0),
        sin.stride(0), Q_HEADS=q_heads, K_HEADS=k_heads, HEAD_DIM=head_dim, HALF=rotary_dim // 2,
        QH_PAD=next_pow2(q_heads), KH_PAD=next_pow2(max(k_heads, 1)),
        HALF_PAD=next_pow2(rotary_dim // 2), Q_COMPUTE=_TL_DTYPES[q_compute],
        K_COMPUTE=_TL_DTYPES[k_compute])
