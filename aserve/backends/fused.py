"""The fused element-wise kernels a layer may run for a tensor, or None for plain torch ops.

    tensor                     rms_norm (in place)      rope (in place, q and k)
    CPU bfloat16               cpu_fused.rms_norm       cpu_fused.rope       (C++)
    CUDA / ROCm bf16 / fp16    rms_norm_triton          rotary_triton        (Triton)
    anything else (fp32, XLA)  None: torch ops, which stay bit-equal to transformers

`argmax_op` (greedy sampling) has the C++ scan for any CPU float32 logits.

The two kinds of ops share one calling convention each (see `rms_norm_op` / `rope_op`), so the
layers ask here and never look at the device themselves.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from aserve.kernels import cpu_fused

RmsNormOp = Callable[[torch.Tensor, torch.Tensor, float, torch.Tensor | None], None]
RopeOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int,
                   int], None]


def _triton_ok(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


def rms_norm_op(x: torch.Tensor) -> RmsNormOp | None:
    """op(x, weight, eps, residual): x <- norm(x) or, with a residual, residual <- x + residual
    and x <- norm(residual); in place."""
    if cpu_fused.usable(x):
        return cpu_fused.rms_norm
    if _triton_ok(x):
        from aserve.kernels.rms_norm import rms_norm_triton

        return rms_norm_triton
    return None


def rope_op(q: torch.Tensor) -> RopeOp | None:
    """op(positions, q, k, cos, sin, head_dim, rotary_dim): neox RoPE on q [T, Hq*D] and
    k [T, Hkv*D] (unit stride along the row), in place."""
    if cpu_fused.usable(q):
        return _cpu_rope
    if _triton_ok(q):
        from aserve.kernels.rotary import rotary_triton

        return rotary_triton
    return None


def argmax_op(logits: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """op(logits [R, V] float32) -> [R] int64, equal to `logits.argmax(-1)`: the C++ scan on
    CPU (~5x torch's at 64 x 49152), else None (torch's argmax)."""
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and cpu_fused.load()):
        return cpu_fused.argmax
    return None


def _cpu_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor, head_dim: int, rotary_dim: int) -> None:
    if (k.data_ptr() == q.data_ptr() + q.shape[1] * q.element_size() and k.stride() == q.stride()
            and q.stride(0) >= q.shape[1] + k.shape[1]):  # k's heads follow q's in each row
        # (a split of the qkv projection's output): one pass over both
        both = q.as_strided((q.shape[0], q.shape[1] + k.shape[1]), q.stride())
        cpu_fused.rope(positions, both, cos, sin, head_dim, rotary_dim)
        return
    for x in (q, k):  # one C++ pass each
        cpu_fused.rope(positions, x, cos, sin, head_dim, rotary_dim)
