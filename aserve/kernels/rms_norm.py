"""RMSNorm with an optional fused residual add, in place: `rms_norm_triton` (CUDA/ROCm, one
program per row) and its torch twin and oracle `rms_norm_ref`.

Both round where HF's LlamaRMSNorm does:

```
with a residual:  residual = residual + x          (in residual's dtype)
                  x = residual                     (in x's dtype)
always:           x = weight * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(x.dtype)
```

The C++ CPU version of the same op lives in `cpu_elementwise`.
"""

from __future__ import annotations

import torch

from aserve.kernels.triton_utils import check_float, next_pow2, require_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the module still imports; rms_norm_triton says what is missing
    triton = None

if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, eps, hidden, stride_x, stride_r,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < hidden
        x_dtype = x_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
            r = (r + x).to(res_ptr.dtype.element_ty)
            tl.store(res_ptr + row * stride_r + cols, r, mask=mask)
            x = r.to(tl.float32).to(x_dtype).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / hidden + eps)
        y = (x * inv).to(x_dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(x_ptr + row * stride_x + cols, (w * y).to(x_dtype), mask=mask)
else:  # no triton: the launchers raise require_triton's RuntimeError
    _rms_norm_kernel = None


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> None:
    """In place: `residual += x` and `x = norm(residual)`; or `x = norm(x)`. x [..., hidden]."""
    if residual is not None:
        residual.add_(x)
        x.copy_(residual)
    x32 = x.float()
    x.copy_(weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype))


def _rows(name: str, x: torch.Tensor, hidden: int) -> torch.Tensor:
    """x as a [rows, hidden] view (writes land in x); ValueError if it has no such view."""
    try:
        return x.view(-1, hidden) if x.dim() != 2 else x
    except RuntimeError as err:
        raise ValueError(f"rms_norm_triton: {name} {tuple(x.shape)} with strides {x.stride()} "
                         "has no [rows, hidden] view.") from err


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None) -> None:
    """`rms_norm_ref` in Triton, in place on x (and residual): x [..., hidden], weight [hidden],
    residual shaped like x (any float dtype: the sum is rounded to it)."""
    tensors = (x, weight) if residual is None else (x, weight, residual)
    require_triton("rms_norm_triton", _rms_norm_kernel, *tensors)
    hidden = x.shape[-1]
    if weight.shape != (hidden,) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"rms_norm_triton: weight must be [{hidden}] and residual like x "
                         f"{tuple(x.shape)}, got {tuple(weight.shape)}, "
                         f"{None if residual is None else tuple(residual.shape)}.")
    check_float("rms_norm_triton", x=x, weight=weight,
                **({} if residual is None else {"residual": residual}))
    rows = _rows("x", x, hidden)  # [rows, hidden]
    res_rows = rows if residual is None else _rows("residual", residual, hidden)
    if rows.shape[0] == 0:
        return
    block = next_pow2(hidden)
    _rms_norm_kernel[(rows.shape[0],)](
        rows, res_rows, weight, float(eps), hidden, rows.stride(0), res_rows.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(4, block // 1024)))
