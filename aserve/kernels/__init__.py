"""Attention and KV-cache kernels. Each has a torch `*_ref` twin with the same signature (the
Triton versions arrive later); this package imports only torch."""

from __future__ import annotations

from aserve.kernels.paged_attention import paged_attention_ref
from aserve.kernels.store_kv import store_kv_ref

__all__ = ["paged_attention_ref", "store_kv_ref"]
