"""The torch reference kernels against dense attention on contiguous K/V: ragged batches of
prefills, decodes and chunks with context, GQA, block sizes, shuffled block tables, sliding
windows, soft caps; and store_kv_ref writes exactly the slots asked."""

from __future__ import annotations

import pytest
import torch
from helpers.attention import MIXED, expected, make_batch

from aserve.kernels import paged_attention_ref, store_kv_ref


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2)])
def test_paged_attention_matches_dense_on_mixed_batch(num_heads, num_kv_heads, head_dim,
                                                      block_size):
    q, kc, vc, starts, lens, table, keys, values = make_batch(
        MIXED, num_heads, num_kv_heads, head_dim, block_size)
    scale = head_dim**-0.5
    out = paged_attention_ref(q, kc, vc, starts, lens, table, scale)
    ref = expected(q, starts, keys, values, scale)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window,soft_cap", [(5, None), (1, None), (None, 2.0), (8, 3.0)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_attention_sliding_window_and_soft_cap(window, soft_cap, block_size):
    q, kc, vc, starts, lens, table, keys, values = make_batch(MIXED, 8, 2, 32, block_size)
    q = q * 4  # large scores, so the cap bites
    out = paged_attention_ref(q, kc, vc, starts, lens, table, 32**-0.5, window, soft_cap)
    ref = expected(q, starts, keys, values, 32**-0.5, window, soft_cap)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_paged_attention_host_lists_and_out_buffer_and_padding_rows():
    q, kc, vc, starts, lens, table, keys, values = make_batch(MIXED, 4, 2, 16, 4)
    padded = torch.cat([q, torch.zeros(3, 4, 16)])  # 3 padding rows past the last request
    out = torch.full_like(padded, 7.0)
    got = paged_attention_ref(padded, kc, vc, starts, lens, table, 0.25, out=out,
                              query_start_loc_cpu=starts.tolist(), seq_lens_cpu=lens.tolist())
    assert got is out
    assert torch.all(out[q.shape[0]:] == 7.0)
    ref = expected(q, starts, keys, values, 0.25)
    torch.testing.assert_close(out[: q.shape[0]].double(), ref, atol=1e-5, rtol=1e-5)


def test_paged_attention_all_decodes_and_single_prefill():
    for reqs in ([(1, 5), (1, 12), (1, 1), (1, 30)], [(25, 25)]):
        q, kc, vc, starts, lens, table, keys, values = make_batch(reqs, 4, 1, 16, 16, seed=3)
        out = paged_attention_ref(q, kc, vc, starts, lens, table, 0.25)
        ref = expected(q, starts, keys, values, 0.25)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_paged_attention_bfloat16_is_close_to_float64():
    q, kc, vc, starts, lens, table, keys, values = make_batch(MIXED, 8, 2, 64, 16,
                                                              dtype=torch.bfloat16)
    out = paged_attention_ref(q, kc, vc, starts, lens, table, 0.125)
    assert out.dtype == torch.bfloat16
    keys = [k.bfloat16() for k in keys]
    values = [v.bfloat16() for v in values]
    ref = expected(q, starts, keys, values, 0.125)
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)


def test_store_kv_writes_exactly_the_asked_slots_and_skips_padding():
    num_blocks, block_size, heads, dim = 4, 4, 2, 8
    kv_cache = torch.zeros(2, num_blocks, block_size, heads, dim)
    key, value = torch.randn(5, heads, dim), torch.randn(5, heads, dim)
    slots = torch.tensor([9, -1, 0, 13, -1])
    store_kv_ref(key, value, kv_cache[0], kv_cache[1], slots)
    k_rows, v_rows = kv_cache[0].view(-1, heads, dim), kv_cache[1].view(-1, heads, dim)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_rows[slot], key[t]) and torch.equal(v_rows[slot], value[t])
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[[9, 0, 13]] = True
    assert torch.all(k_rows[~written] == 0) and torch.all(v_rows[~written] == 0)


def test_store_kv_rejects_mismatched_shapes():
    kv_cache = torch.zeros(2, 2, 4, 2, 8)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv_ref(torch.randn(3, 2, 8), torch.randn(3, 2, 8), kv_cache[0], kv_cache[1],
                     torch.tensor([0, 1]))


@pytest.mark.parametrize("window", [None, 3])
def test_paged_attention_with_the_steps_own_kv_rows_matches_the_cache_path(window):
    reqs = MIXED + [(9, 9), (16, 16)]  # whole prompts take the fresh-rows path
    q, kc, vc, starts, lens, table, keys, values = make_batch(reqs, 8, 2, 32, 4)
    rows_k = torch.cat([k[s - n:] for k, (n, s) in zip(keys, reqs, strict=True)])
    rows_v = torch.cat([v[s - n:] for v, (n, s) in zip(values, reqs, strict=True)])
    out = paged_attention_ref(q, kc, vc, starts, lens, table, 32**-0.5, window,
                              key=rows_k, value=rows_v)
    torch.testing.assert_close(out.double(), expected(q, starts, keys, values, 32**-0.5, window),
                               atol=1e-5, rtol=1e-5)
