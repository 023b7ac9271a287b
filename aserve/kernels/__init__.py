"""Attention, KV-cache, norm and rotary kernels: each Triton kernel (CUDA/ROCm) sits next to its
torch `*_ref` twin of the same signature (used on CPU and XLA, and the oracle in tests). This
package imports only torch and, when installed, triton."""

from __future__ import annotations

from aserve.kernels.paged_attention import paged_attention_ref
from aserve.kernels.paged_attention_triton import choose_num_splits, paged_attention_triton
from aserve.kernels.rms_norm import rms_norm_ref, rms_norm_triton
from aserve.kernels.rotary import rope_ref, rotary_ref, rotary_triton
from aserve.kernels.store_kv import store_kv_ref, store_kv_triton

__all__ = [
    "choose_num_splits",
    "paged_attention_ref",
    "paged_attention_triton",
    "rms_norm_ref",
    "rms_norm_triton",
    "rope_ref",
    "rotary_ref",
    "rotary_triton",
    "store_kv_ref",
    "store_kv_triton",
]
