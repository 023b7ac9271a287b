"""The torch reference kernels against dense attention on contiguous K/V: ragged batches of
prefills, decodes and chunks with context, GQA, block sizes, shuffled block tables, sliding
windows, soft caps; and store_kv_ref writes exactly the slots asked."""

from __future__ import annotations

import pytest
import torch

from aserve.kernels import paged_attention_ref, store_kv_ref

# (q_len, seq_len) per request: a full prefill, decodes, chunks after cached context
MIXED = [(7, 7), (1, 9), (3, 20), (1, 1), (5, 17), (1, 33), (16, 40)]


def dense_attention(q, k, v, scale, window=None, soft_cap=None):
    """q [Lq, Hq, D] = last Lq of the Lk tokens whose keys are k/v [Lk, Hkv, D]; float64."""
    q_len, seq_len, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale  # [Hq, Lq, Lk]
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)  # [Lq, Hq, D]


def make_batch(reqs, num_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32,
               seed=0):
    """Random K/V per request scattered into a paged cache through a shuffled block table."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-s // block_size) for _, s in reqs]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    width = max(need) + 1
    table = torch.full((len(reqs), width), -1, dtype=torch.int32)  # -1 past each need
    keys, values, queries = [], [], []
    for r, (q_len, seq_len) in enumerate(reqs):
        blocks = [perm.pop() for _ in range(need[r])]
        table[r, : need[r]] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        for pos in range(seq_len):
            k_cache[blocks[pos // block_size], pos % block_size] = k[pos]
            v_cache[blocks[pos // block_size], pos % block_size] = v[pos]
        keys.append(k)
        values.append(v)
        queries.append(torch.randn(q_len, num_heads, head_dim, generator=gen))
    starts = torch.tensor([0] + [q for q, _ in reqs], dtype=torch.int32).cumsum(0).int()
    seq_lens = torch.tensor([s for _, s in reqs], dtype=torch.int32)
    q = torch.cat(queries).to(dtype)
    return q, k_cache.to(dtype), v_cache.to(dtype), starts, seq_lens, table, keys, values


def expected(q, starts, keys, values, scale, window=None, soft_cap=None):
    parts = []
    for r, (k, v) in enumerate(zip(keys, values, strict=True)):
        parts.append(dense_attention(q[starts[r]:starts[r + 1]], k, v, scale, window, soft_cap))
    return torch.cat(parts)


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
