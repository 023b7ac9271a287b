"""Paged attention on CPU for any float dtype: decode rows through a scalar C++ kernel
(`csrc/paged_decode.h`, in the extension of `cpu_extension.load`) that reads K/V straight from
the paged cache, prefill chunks through SDPA as in the reference. The fallback of
`cpu_attention.cpu_attention_forward` where its AVX-512 row-tile kernel does not apply (fp16, no
AVX-512, head_dim % 16); without a C++ toolchain, `paged_attention_ref`, its oracle.
"""

from __future__ import annotations

import torch

from aserve.kernels import cpu_extension
from aserve.kernels.paged_attention import (
    attend_chunks,
    batch_layout,
    checked_sinks,
    paged_attention_ref,
)


def load_kernel():
    """The compiled CPU extension (`cpu_extension.load`), or None if it cannot be built here."""
    return cpu_extension.load()


def paged_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        block_table: torch.Tensor, scale: float,
                        sliding_window: int | None = None, soft_cap: float | None = None,
                        out: torch.Tensor | None = None, *,
                        query_start_loc_cpu: list[int] | None = None,
                        seq_lens_cpu: list[int] | None = None,
                        key: torch.Tensor | None = None,
                        value: torch.Tensor | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`paged_attention_ref`'s signature and results; decode rows run the C++ kernel."""
    module = load_kernel() if q.device.type == "cpu" else None
    if module is None or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return paged_attention_ref(
            q, k_cache, v_cache, query_start_loc, seq_lens, block_table, scale, sliding_window,
            soft_cap, out, query_start_loc_cpu=query_start_loc_cpu, seq_lens_cpu=seq_lens_cpu,
            key=key, value=value, sinks=sinks)
    q = q.contiguous()
    sinks = checked_sinks("paged_attention_cpu", sinks, q)
    starts, lens, decodes, out = batch_layout(q, k_cache, query_start_loc, seq_lens, out,
                                              query_start_loc_cpu, seq_lens_cpu)
    if decodes:
        target = out if out.is_contiguous() else torch.empty_like(q)
        module.paged_decode(
            q, k_cache, v_cache, block_table.to(torch.int32).contiguous(),
            seq_lens.to(torch.int32).contiguous(), torch.tensor(decodes, dtype=torch.int64),
            torch.tensor([starts[r] for r in decodes], dtype=torch.int64), target, scale,
            sliding_window or 0, soft_cap or 0.0, sinks)
        if target is not out:
            rows = [starts[r] for r in decodes]
            out[rows] = target[rows]
    attend_chunks(q, k_cache, v_cache, starts, lens, block_table, scale, sliding_window,
                  soft_cap, out, key, value, sinks=sinks)
    return out
