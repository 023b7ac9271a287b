"""The C++ CPU decode kernel against its oracle, `paged_attention_ref`, over a grid of shapes."""

from __future__ import annotations

import pytest
import torch
from test_kernels_ref import MIXED, make_batch

from aserve.kernels.paged_attention import paged_attention_ref
from aserve.kernels.paged_attention_cpu import load_kernel, paged_attention_cpu

pytestmark = pytest.mark.skipif(load_kernel() is None, reason="no C++ toolchain to build it")

DECODES = [(1, 1), (1, 5), (1, 16), (1, 17), (1, 40), (1, 33)]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2),
                                       (torch.float16, 2e-3)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (9, 3), (4, 1)])
@pytest.mark.parametrize("head_dim,block_size", [(16, 4), (64, 16), (128, 16), (80, 32)])
def test_cpu_kernel_matches_the_reference(dtype, tol, num_heads, num_kv_heads, head_dim,
                                          block_size):
    q, kc, vc, starts, lens, table, _, _ = make_batch(MIXED + DECODES, num_heads, num_kv_heads,
                                                      head_dim, block_size, dtype=dtype)
    table = table.clamp(min=0)  # the kernel reads only a request's own entries
    scale = head_dim**-0.5
    got = paged_attention_cpu(q, kc, vc, starts, lens, table, scale)
    want = paged_attention_ref(q.double(), kc.double(), vc.double(), starts, lens, table, scale)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("window,soft_cap", [(5, None), (1, None), (None, 2.0), (8, 3.0)])
def test_cpu_kernel_sliding_window_and_soft_cap(window, soft_cap):
    q, kc, vc, starts, lens, table, _, _ = make_batch(DECODES, 8, 2, 32, 4)
    table = table.clamp(min=0)
    q = q * 4
    got = paged_attention_cpu(q, kc, vc, starts, lens, table, 32**-0.5, window, soft_cap)
    want = paged_attention_ref(q, kc, vc, starts, lens, table, 32**-0.5, window, soft_cap)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_cpu_kernel_writes_only_decode_rows_of_out():
    q, kc, vc, starts, lens, table, _, _ = make_batch(DECODES, 4, 2, 16, 4)
    padded = torch.cat([q, torch.zeros(2, 4, 16)])
    out = torch.full_like(padded, 7.0)
    paged_attention_cpu(padded, kc, vc, starts, lens, table.clamp(min=0), 0.25, out=out)
    assert torch.all(out[q.shape[0]:] == 7.0)
    want = paged_attention_ref(q, kc, vc, starts, lens, table.clamp(min=0), 0.25)
    torch.testing.assert_close(out[: q.shape[0]], want, atol=1e-5, rtol=1e-5)
