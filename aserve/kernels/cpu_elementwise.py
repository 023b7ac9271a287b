"""Fused bfloat16 element-wise ops for CPU: residual-add + RMSNorm, RoPE (neox style), SiLU-and-mul,
GELU(tanh)-and-mul, gpt-oss' clamped SwiGLU.

At decode batch sizes a layer's element-wise work is a dozen tiny torch ops each, and their
dispatch costs more than their arithmetic; here each is one C++ loop (`csrc/elementwise.h`).
Every op rounds to bfloat16 where the torch formulation (its `*_ref` twin) does, so results
match it to the last bit in almost every element (float32 reductions may differ in order; GELU's
tanh is not torch's, yet it rounds to torch's bf16 for every gate value). Built on first use
(`cpu_extension.load`); `usable()` is False where it cannot be built. The twins live with the
other platforms' versions and are re-exported here: `rms_norm_ref` and `rope_ref` with their
Triton kernels (`rms_norm.py`, `rotary.py`), the gated activations' in `activation.py`.
"""

from __future__ import annotations

import torch

from aserve.kernels import cpu_extension
from aserve.kernels.activation import gelu_tanh_and_mul_ref as gelu_tanh_and_mul_ref
from aserve.kernels.activation import silu_and_mul_ref as silu_and_mul_ref
from aserve.kernels.activation import swiglu_oai_and_mul_ref as swiglu_oai_and_mul_ref
from aserve.kernels.rms_norm import rms_norm_ref as rms_norm_ref
from aserve.kernels.rotary import rope_ref as rope_ref


def _module():
    return cpu_extension.load()


def load() -> bool:
    """Build (or load the cached build) now; whether the fused ops are available."""
    return _module() is not None


def usable(x: torch.Tensor) -> bool:
    """Whether the fused ops apply: a contiguous CPU bfloat16 tensor, and the build works."""
    return x.device.type == "cpu" and x.dtype == torch.bfloat16 and _module() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> None:
    """In place: `residual += x` (bf16) and `x = norm(residual)`; or `x = norm(x)`."""
    _module().rms_norm(x, residual, weight, eps)


def rope(positions: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         head_dim: int, rotary_dim: int) -> None:
    """In place on x [T, H * head_dim] (rows may be strided)."""
    _module().rope(positions, x, cos, sin, head_dim, rotary_dim)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """[R, V] float32 -> [R] int64, exactly `logits.argmax(-1)` (first maximum; NaN wins)."""
    return _module().argmax_rows(logits.contiguous())


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2d] = [gate | up] -> silu(gate) * up, [T, d]."""
    out = x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
    _module().silu_and_mul(out, x)
    return out


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2d] = [gate | up] -> gelu_tanh(gate) * up, [T, d]."""
    out = x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
    _module().gelu_tanh_and_mul(out, x)
    return out


def swiglu_oai_and_mul(x: torch.Tensor, alpha: float = 1.702,
                       limit: float | None = None) -> torch.Tensor:
    """[T, 2d] = [gate | up] -> gpt-oss' (up + 1) * gate * sigmoid(alpha * gate), gate clamped
    above at `limit` and up to [-limit, limit] (`swiglu_oai_and_mul_ref`), [T, d]."""
    out = x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
    _module().swiglu_oai_and_mul(out, x, alpha, float("inf") if limit is None else limit)
    return out
