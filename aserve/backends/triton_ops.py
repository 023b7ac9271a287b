"""The CUDA / ROCm platforms' kernels (`CudaPlatform.kernel_ops`): the Triton kernels of
`aserve/kernels`, each checked against its torch `*_ref` twin.

    dtype        attention                norms, RoPE       silu, argmax, linears   fused MoE
    bf16 / fp16  store_kv_triton,         rms_norm_triton,  torch (F.silu, argmax,  fused_moe_triton
                 paged_attention_triton   rotary_triton     F.linear)
    float32      Triton, as above         references        torch                   fused_moe_triton

A quantized checkpoint's linear weights (GGUF quant types, GPTQ, AWQ, compressed-tensors int)
stay as integers for the Triton W4A16 / W8A16 GEMM (`quant_gemm_triton`) in bf16 / fp16; float
weights stay with F.linear.

The norm and RoPE wrappers keep the op's calling convention for every input: what the Triton
kernel does not take (a non-contiguous tensor, [T, H, D] rows, int32 positions) goes to the
reference. `fused_moe` makes a layer's expert weights contiguous once, after loading (not per
step).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from aserve.backends.ops import ExpertWeights, FusedMoEFn, KernelOps, LinearToPack, PackedLinear
from aserve.kernels.fused_moe_triton import fused_moe_triton
from aserve.kernels.rms_norm import rms_norm_ref, rms_norm_triton
from aserve.kernels.rotary import rotary_ref, rotary_triton


def triton_kernel_ops(dtype: torch.dtype) -> KernelOps:
    from aserve.kernels.paged_attention_triton import paged_attention_triton
    from aserve.kernels.store_kv import store_kv_triton

    common = {"store_kv": store_kv_triton, "paged_attention": paged_attention_triton,
              "fused_moe": fused_moe}
    if dtype not in (torch.bfloat16, torch.float16):
        return KernelOps("triton", **common)
    return KernelOps("triton-fused", **common, rms_norm=rms_norm, rope=rope,
                     pack_linears=pack_quantized)


def pack_quantized(weights: Sequence[LinearToPack]) -> list[PackedLinear | None]:
    """A quantized checkpoint's weights in the Triton GEMM's layout, on their device; None for
    every other weight (it stays with F.linear)."""
    from aserve.kernels.quant_gemm_triton import TritonQuantWeight

    packed: list[PackedLinear | None] = []
    for weight, _, quantized in weights:
        int_weight = quantized() if quantized is not None else None
        if int_weight is None or not TritonQuantWeight.supports(int_weight):
            packed.append(None)
        else:
            packed.append(TritonQuantWeight(int_weight, weight.device))
    return packed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> None:
    """`rms_norm_ref`; contiguous rows in Triton."""
    if x.is_contiguous() and (residual is None or residual.is_contiguous()):
        rms_norm_triton(x, weight, eps, residual)
    else:
        rms_norm_ref(x, weight, eps, residual)


def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor,
         sin: torch.Tensor, head_dim: int, rotary_dim: int) -> None:
    """`rotary_ref`; [T, H * D] rows with unit inner stride and int64 positions in Triton."""
    rows = (q,) if k is None else (q, k)
    if positions.dtype == torch.int64 and all(x.dim() == 2 and x.stride(1) == 1 for x in rows):
        rotary_triton(positions, q, k, cos, sin, head_dim, rotary_dim)
    else:
        rotary_ref(positions, q, k, cos, sin, head_dim, rotary_dim)


def fused_moe(w: ExpertWeights) -> FusedMoEFn:
    """`fused_moe_triton` over `w`'s tensors, made contiguous here once (not per step)."""
    w13, w2 = w.w13.contiguous(), w.w2.contiguous()
    w13_bias = None if w.w13_bias is None else w.w13_bias.contiguous()
    w2_bias = None if w.w2_bias is None else w.w2_bias.contiguous()

    def run(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, activation=w.activation,
                                w13_bias=w13_bias, w2_bias=w2_bias, expert_map=w.expert_map,
                                alpha=w.alpha, limit=w.limit)
    return run
