"""Sliding-window and soft-cap bounds of every attention kernel against transformers' rule, and
the hybrid KV cache's out-of-window blocks.

The oracle, `hf_attention`, is dense float32 attention built from transformers' own mask
functions (`masking_utils`: key j is visible to query p iff j <= p and p - j < W) in Gemma-2's
order (scores * scale, soft cap `cap * tanh(s / cap)`, mask added, float32 softmax); a test
checks it against transformers' Gemma-2 eager attention. Every kernel runs the same ragged
batches: decodes, prefills from 0, and chunks after cached context that cross the window (longer
and shorter than it), over windows 1, 2, 5, 7, 16, 33, one past every sequence and none.

The hybrid cache frees a request's blocks that lie wholly before the first key its first query
of the step sees (`p - W + 1`; drawn in `helpers/hybrid_batch.py`, which builds the batches):
`hybridise` writes large garbage into such blocks and re-points their entries; every kernel's
output must stay bit for bit what it was.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers.hybrid_batch import (
    Batch,
    assert_hybrid_changes_something,
    hybridise,
    make_batch,
    out_of_window_columns,
    run_cpu_op,
    triton_attention,
)

from aserve.kernels.paged_attention import paged_attention_ref
from aserve.kernels.store_kv import store_kv_ref

WINDOWS = [1, 2, 5, 7, 16, 33, 1000, None]  # 7: no multiple of a block; 1000: past every sequence
# (q_len, seq_len): decodes, prefills from 0, chunks after context (shorter and longer than W)
REQS = [(1, 1), (1, 6), (1, 37), (9, 9), (23, 23), (3, 20), (20, 50), (6, 41), (1, 64)]
# (head_dim, num_heads, num_kv_heads): GQA ratios 1 and 4
SHAPES = [(16, 2, 2), (64, 8, 2), (128, 4, 1), (128, 2, 2)]


def hf_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 window: int | None, soft_cap: float | None) -> torch.Tensor:
    """q [Lq, Hq, D], the last Lq of the Lk tokens whose keys are k/v [Lk, Hkv, D]: float32
    [Lq, Hq, D] with transformers' mask and Gemma-2's order of scale, soft cap and mask."""
    from transformers.masking_utils import (
        causal_mask_function,
        sliding_window_causal_mask_function,
    )

    q_len, seq_len, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    visible_fn = (causal_mask_function if window is None
                  else sliding_window_causal_mask_function(window))
    q_idx = torch.arange(seq_len - q_len, seq_len).view(-1, 1)
    visible = visible_fn(0, 0, q_idx, torch.arange(seq_len).view(1, -1))  # [Lq, Lk]
    mask = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
    qh = q.float().transpose(0, 1)  # [Hq, Lq, D]
    kh = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, Lk, D]
    vh = v.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, Lk, D]
    scores = torch.matmul(qh, kh.transpose(1, 2)) * scale  # [Hq, Lq, Lk]
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    probs = torch.softmax(scores + mask, dim=-1, dtype=torch.float32)
    return torch.matmul(probs, vh).transpose(0, 1)  # [Lq, Hq, D]


def expected(batch: Batch, scale: float, window: int | None,
             soft_cap: float | None) -> torch.Tensor:
    starts = batch.starts.tolist()
    return torch.cat([hf_attention(batch.q[starts[r]:starts[r + 1]], k, v, scale, window,
                                   soft_cap)
                      for r, (k, v) in enumerate(zip(batch.keys, batch.values, strict=True))])


@pytest.mark.parametrize("window", [1, 3, 7, None])
@pytest.mark.parametrize("soft_cap", [None, 50.0])
def test_oracle_is_transformers_gemma2_eager_attention(window, soft_cap):
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(6, 8, 32, generator=gen) * 12  # the last 6 of 11 positions; scores ~50
    k, v = torch.randn(11, 2, 32, generator=gen), torch.randn(11, 2, 32, generator=gen)
    fn = sliding_window_causal_mask_function(window or 10**6)
    visible = sdpa_mask(batch_size=1, q_length=6, kv_length=11, q_offset=5, mask_function=fn,
                        allow_is_causal_skip=False)  # [1, 1, 6, 11]
    mask = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
    module = SimpleNamespace(num_key_value_groups=4, training=False)
    want, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                      v.transpose(0, 1)[None], mask, scaling=32**-0.5,
                                      softcap=soft_cap)
    got = hf_attention(q, k, v, 32**-0.5, window, soft_cap)
    torch.testing.assert_close(got, want[0], atol=1e-6, rtol=1e-6)
    if soft_cap is not None and window != 1:  # the cap bites at these scores (W = 1: one key)
        assert (got - hf_attention(q, k, v, 32**-0.5, window, None)).abs().max() > 1e-2


def test_hybrid_blocks_lie_wholly_out_of_window():
    """Guards the test itself: a freed block holds no key any query of its request sees."""
    batch = make_batch(REQS, 16, 2, 2, 4)
    starts, lens = batch.starts.tolist(), batch.seq_lens.tolist()
    for window in (1, 5, 7, 16):
        for r, cols in enumerate(out_of_window_columns(batch, window)):
            first_query = lens[r] - (starts[r + 1] - starts[r])
            assert all((col + 1) * 4 - 1 < first_query - window + 1 for col in cols)
            assert len(cols) == max(0, first_query - window + 1) // 4


@pytest.mark.parametrize("soft_cap", [None, 50.0])
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", SHAPES)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", WINDOWS)
def test_ref_matches_hf_and_ignores_out_of_window_blocks(window, block_size, head_dim,
                                                         num_heads, num_kv_heads, soft_cap):
    batch = make_batch(REQS, head_dim, num_heads, num_kv_heads, block_size,
                       q_scale=1.0 if soft_cap is None else 12.0)
    hybrid = hybridise(batch, window)
    assert_hybrid_changes_something(batch, hybrid, window)
    scale = head_dim**-0.5
    want = expected(batch, scale, window, soft_cap)
    outs = []
    for b in (batch, hybrid):
        k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
        k_cache.view(-1, num_kv_heads, head_dim)[b.slots] = 0  # this step's rows: stored below
        v_cache.view(-1, num_kv_heads, head_dim)[b.slots] = 0
        store_kv_ref(b.key, b.value, k_cache, v_cache, b.slots)
        args = (b.q, k_cache, v_cache, b.starts, b.seq_lens, b.table, scale, window, soft_cap)
        outs.append(paged_attention_ref(*args))
        outs.append(paged_attention_ref(*args, key=b.key, value=b.value))  # prompts: own rows
    torch.testing.assert_close(outs[0], want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(outs[1], want, atol=2e-5, rtol=2e-5)
    assert torch.equal(outs[2], outs[0]) and torch.equal(outs[3], outs[1])


CPU_TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.usefixtures("cpu_attention_kernel")
@pytest.mark.parametrize("op", ["attention_forward", "paged_attention"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("soft_cap", [None, 50.0])
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", SHAPES)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", WINDOWS)
def test_cpu_ops_match_hf_and_ignore_out_of_window_blocks(window, block_size, head_dim,
                                                          num_heads, num_kv_heads, soft_cap,
                                                          dtype, op):
    batch = make_batch(REQS, head_dim, num_heads, num_kv_heads, block_size, dtype,
                       q_scale=1.0 if soft_cap is None else 12.0)
    hybrid = hybridise(batch, window)
    scale = head_dim**-0.5
    got = run_cpu_op(op, batch, REQS, scale, window, soft_cap)
    torch.testing.assert_close(got.float(), expected(batch, scale, window, soft_cap),
                               atol=CPU_TOL[dtype], rtol=CPU_TOL[dtype])
    assert torch.equal(run_cpu_op(op, hybrid, REQS, scale, window, soft_cap), got)


# chunks cpu_attention.goes_to_sdpa sends to SDPA where SDPA_FOR_LONG_CHUNKS, with and without
# cached context
LONG = [(1100, 1100), (1030, 1060), (1, 1200), (5, 90)]


@pytest.mark.usefixtures("cpu_attention_kernel")
@pytest.mark.parametrize("window,soft_cap", [(7, None), (33, 50.0), (2000, None)])
def test_cpu_forward_long_chunks_match_hf_and_ignore_out_of_window_blocks(window, soft_cap,
                                                                         monkeypatch):
    from aserve.kernels import cpu_attention
    from aserve.kernels.cpu_attention import goes_to_sdpa

    monkeypatch.setattr(cpu_attention, "SDPA_FOR_LONG_CHUNKS", True)  # (as on AMX machines)
    assert goes_to_sdpa(*np.array(LONG).T).any()
    batch = make_batch(LONG, 64, 4, 1, 16, torch.bfloat16,
                       q_scale=1.0 if soft_cap is None else 12.0)
    hybrid = hybridise(batch, window)
    assert_hybrid_changes_something(batch, hybrid, window)
    got = run_cpu_op("attention_forward", batch, LONG, 0.125, window, soft_cap)
    torch.testing.assert_close(got.float(), expected(batch, 0.125, window, soft_cap),
                               atol=2e-2, rtol=2e-2)
    assert torch.equal(run_cpu_op("attention_forward", hybrid, LONG, 0.125, window, soft_cap),
                       got)


# The Triton kernel under the interpreter (slow): fewer requests, over the same bounds
TRITON_REQS = [(1, 6), (1, 37), (9, 9), (3, 20), (20, 45)]


# (the interpreter takes ~1 s a case: soft-caps on both shapes, not every pair of them)
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads,num_splits,soft_cap",
                         [(16, 2, 2, 1, None), (16, 2, 2, 1, 50.0), (64, 8, 2, 2, 50.0)])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("window", [1, 7, 33, None])
def test_triton_matches_hf_and_ignores_out_of_window_blocks(window, block_size, head_dim,
                                                            num_heads, num_kv_heads, num_splits,
                                                            soft_cap):
    run_triton = triton_attention()
    batch = make_batch(TRITON_REQS, head_dim, num_heads, num_kv_heads, block_size,
                       q_scale=1.0 if soft_cap is None else 12.0)
    hybrid = hybridise(batch, window)
    assert_hybrid_changes_something(batch, hybrid, window)
    scale = head_dim**-0.5
    got = run_triton(batch, scale, window, soft_cap, num_splits)
    torch.testing.assert_close(got, expected(batch, scale, window, soft_cap), atol=2e-5,
                               rtol=2e-5)
    assert torch.equal(run_triton(hybrid, scale, window, soft_cap, num_splits), got)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window,soft_cap", [(5, 50.0), (7, None)])
def test_triton_half_precision_matches_hf_and_ignores_out_of_window_blocks(dtype, window,
                                                                           soft_cap):
    run_triton = triton_attention()
    batch = make_batch(TRITON_REQS, 64, 4, 1, 4, dtype, q_scale=1.0 if soft_cap is None else 12.0)
    hybrid = hybridise(batch, window)
    got = run_triton(batch, 0.125, window, soft_cap, 1)
    tol = 3e-2 if dtype == torch.bfloat16 else 5e-3
    torch.testing.assert_close(got.float(), expected(batch, 0.125, window, soft_cap), atol=tol,
                               rtol=tol)
    assert torch.equal(run_triton(hybrid, 0.125, window, soft_cap, 1), got)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
@pytest.mark.parametrize("window", [1, 7, 16])
def test_kernels_that_skip_freed_blocks_never_read_them(window, poison):
    """The C++ row tiles and decode rows and the Triton kernel start each request's keys at the
    block of its first query's first key: not even NaN or inf in the freed blocks reaches them
    (the SDPA paths mask such keys, so they need finite values there)."""
    from aserve.kernels.paged_attention_cpu import load_kernel

    decodes = [r for r in REQS if r[0] == 1]
    cases = [(REQS, torch.bfloat16, "attention_forward"),
             (decodes, torch.float16, "paged_attention"),
             (decodes, torch.bfloat16, "paged_attention")]
    module = load_kernel()
    for reqs, dtype, op in cases if module is not None else []:
        batch = make_batch(reqs, 64, 8, 2, 4, dtype)
        hybrid = hybridise(batch, window, poison)
        assert not torch.equal(batch.table, hybrid.table)
        if op == "attention_forward" and not module.rows_supported(batch.q):
            continue  # no AVX-512 here: SDPA chunks
        got = run_cpu_op(op, hybrid, reqs, 0.125, window, None)
        assert torch.equal(got, run_cpu_op(op, batch, reqs, 0.125, window, None))
    run_triton = triton_attention()
    for block_size in (1, 4, 16):
        batch = make_batch(TRITON_REQS, 16, 4, 2, block_size)
        got = run_triton(hybridise(batch, window, poison), 0.25, window, None, 1)
        assert torch.equal(got, run_triton(batch, 0.25, window, None, 1))
