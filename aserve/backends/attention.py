"""Which kernels the attention layer runs, by attention backend and dtype.

    backend   dtype            store_kv          paged_attention
    triton    any              store_kv_triton   paged_attention_triton   (CUDA, ROCm)
    cpu       bf16 / fp16      store_kv_ref      paged_attention_cpu      (C++ decode rows)
              forward: C++ store_kv + row-tile attention for every row (bf16, AVX-512)
    cpu       fp32             store_kv_ref      paged_attention_ref      (bit-equal to HF)
    ref       any              store_kv_ref      paged_attention_ref      (XLA, tests)

Every pair has the signatures of `store_kv_ref` / `paged_attention_ref`; a backend with a
`forward` runs that instead of the pair.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from aserve.kernels.paged_attention import paged_attention_ref
from aserve.kernels.store_kv import store_kv_ref

ATTENTION_BACKENDS = ("triton", "cpu", "ref")


@dataclass(frozen=True)
class AttentionOps:
    name: str
    store_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    # Optional: store + attend in one go, (q, k, v, k_cache, v_cache, metadata, scale, window,
    # soft_cap) -> out, with whatever it plans per step kept on `metadata.kernel_plan`.
    forward: Callable[..., torch.Tensor] | None = None


def attention_ops(backend: str, dtype: torch.dtype) -> AttentionOps:
    """The kernels of `backend` for activations of `dtype`."""
    if backend == "triton":
        from aserve.kernels.paged_attention_triton import paged_attention_triton
        from aserve.kernels.store_kv import store_kv_triton

        return AttentionOps("triton", store_kv_triton, paged_attention_triton)
    if backend == "cpu" and dtype != torch.float32:
        from aserve.kernels.cpu_attention import cpu_attention_forward
        from aserve.kernels.paged_attention_cpu import paged_attention_cpu

        return AttentionOps("cpu", store_kv_ref, paged_attention_cpu, cpu_attention_forward)
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}: expected one of "
                         f"{', '.join(ATTENTION_BACKENDS)}")
    return AttentionOps("ref", store_kv_ref, paged_attention_ref)
