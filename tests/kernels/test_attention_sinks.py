"""Attention sinks (gpt-oss) in every attention kernel, against transformers' gpt-oss attention.

gpt-oss gives each query head h a learned logit `sinks[h]` that joins every row's softmax and
carries no value: p_j = exp(s_j - m) / (exp(sinks[h] - m) + sum_i exp(s_i - m)), m the max over
the visible scores and the sink, whatever the window (gpt-oss alternates window-128 and full
layers). The oracle, `hf_sink_attention`, is transformers' own `eager_attention_forward` of
gpt_oss, called with a stand-in module (`sinks`, `num_key_value_groups`, `training=False`) and
the additive mask of transformers' eager path (from its causal / sliding-window mask functions,
finfo.min where hidden), as tests/kernels/test_sliding_window.py builds it; a test checks the
oracle against the closed form out = out_without_sink * sigmoid(lse - sink).

Every kernel runs the ragged batches of `helpers/hybrid_batch.py` (decodes, prefills from 0,
chunks after cached context, across the window), also as the hybrid cache leaves them (garbage
in freed blocks: the output must not change by a bit). Sinks are drawn "moderate" (N(0, 2):
they take a share like a key's) or "mixed" (per head in turn: moderate, dominant at +20, where
the sink takes nearly all the weight and outputs are ~1e-9, and negligible at -20). Outputs
are compared relative to each (token, head) row's size (`assert_rows_close`), so that a
dominant sink's tiny rows are checked as closely as the others.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers.attention import build_metadata, dense_attention
from helpers.hybrid_batch import (
    Batch,
    assert_hybrid_changes_something,
    hybridise,
    make_batch,
    run_cpu_op,
    triton_attention,
)

from aserve.kernels.paged_attention import paged_attention_ref
from aserve.kernels.store_kv import store_kv_ref

# (q_len, seq_len): decodes, prefills from 0, chunks after context (shorter and longer than W)
REQS = [(1, 1), (1, 6), (1, 37), (9, 9), (23, 23), (3, 20), (20, 50), (6, 41), (1, 64)]
# (head_dim, num_heads, num_kv_heads): GQA ratios 1, 4 and 4 onto one kv head
SHAPES = [(16, 2, 2), (64, 8, 2), (128, 4, 1)]
WINDOWS = [1, 7, 33, None]


def make_sinks(kind: str, num_heads: int, seed: int = 0) -> torch.Tensor:
    """float32 [num_heads]: "moderate" N(0, 2); "mixed": head h moderate, dominant (+20) or
    negligible (-20) by h % 3."""
    sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2
    if kind == "mixed":
        sinks += torch.tensor([0.0, 20.0, -20.0]).repeat(num_heads)[:num_heads]
    return sinks


def hf_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      window: int | None, sinks: torch.Tensor) -> torch.Tensor:
    """q [Lq, Hq, D], the last Lq of the Lk tokens whose keys are k/v [Lk, Hkv, D]: float32
    [Lq, Hq, D] from transformers' gpt-oss eager attention with transformers' mask."""
    from transformers.masking_utils import (
        causal_mask_function,
        sliding_window_causal_mask_function,
    )
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    q_len, seq_len = q.shape[0], k.shape[0]
    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    q_idx = torch.arange(seq_len - q_len, seq_len).view(-1, 1)
    visible = fn(0, 0, q_idx, torch.arange(seq_len).view(1, -1))  # [Lq, Lk]
    mask = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
    module = SimpleNamespace(sinks=sinks.float(), num_key_value_groups=q.shape[1] // k.shape[1],
                             training=False)
    out, _ = eager_attention_forward(module, *(x.float().transpose(0, 1)[None] for x in (q, k, v)),
                                     mask, scaling=scale)
    return out[0]  # [Lq, Hq, D]


def expected(batch: Batch, scale: float, window: int | None, sinks: torch.Tensor
             ) -> torch.Tensor:
    starts = batch.starts.tolist()
    return torch.cat([hf_sink_attention(batch.q[starts[r]:starts[r + 1]], k, v, scale, window,
                                        sinks)
                      for r, (k, v) in enumerate(zip(batch.keys, batch.values, strict=True))])


def assert_rows_close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """Every element within `tol` times its (token, head) row's largest |want|, or times the
    smallest normal number of got's dtype where that is larger (fp16 flushes a dominant sink's
    ~1e-9 rows to its subnormals or 0)."""
    size = want.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(got.dtype).tiny)
    err = ((got.float() - want).abs() / size).amax().item()
    assert err <= tol, f"max error {err:.3g} of a row's size (tolerance {tol:.3g})"


def test_oracle_weighs_each_row_down_by_its_sink_and_nothing_else():
    """transformers' gpt-oss attention is softmax attention scaled by sigmoid(lse - sink): the
    sink is unscaled, never masked, and carries no value (the float64 closed form)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(6, 8, 32, generator=gen) * 3  # the last 6 of 11 positions
    k, v = torch.randn(11, 2, 32, generator=gen), torch.randn(11, 2, 32, generator=gen)
    scale = 32**-0.5
    for window in (1, 4, None):
        for sinks in (make_sinks("moderate", 8), make_sinks("mixed", 8)):
            plain = dense_attention(q, k, v, scale, window)  # [6, 8, 32] float64
            kk = k.double().repeat_interleave(4, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale  # [8, 6, 11]
            q_pos, k_pos = torch.arange(5, 11)[:, None], torch.arange(11)[None, :]
            hidden = (k_pos > q_pos) | (window is not None and k_pos <= q_pos - window)
            lse = scores.masked_fill(hidden, float("-inf")).logsumexp(-1)  # [8, 6]
            weight = torch.sigmoid(lse - sinks.double()[:, None]).T[..., None]  # [6, 8, 1]
            got = hf_sink_attention(q, k, v, scale, window, sinks)
            torch.testing.assert_close(got.double(), plain * weight, atol=1e-6, rtol=1e-5)
        far_below = hf_sink_attention(q, k, v, scale, window, torch.full((8,), -1e4))
        torch.testing.assert_close(far_below.double(), plain, atol=1e-6, rtol=1e-5)


def _ref_outputs(b: Batch, scale: float, window: int | None, sinks: torch.Tensor
                 ) -> list[torch.Tensor]:
    """The reference over the batch's cache (this step's rows stored by `store_kv_ref`), then
    with this step's own K/V rows for the prompts."""
    num_kv_heads, head_dim = b.k_cache.shape[2:]
    k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
    k_cache.view(-1, num_kv_heads, head_dim)[b.slots] = 0
    v_cache.view(-1, num_kv_heads, head_dim)[b.slots] = 0
    store_kv_ref(b.key, b.value, k_cache, v_cache, b.slots)
    args = (b.q, k_cache, v_cache, b.starts, b.seq_lens, b.table, scale, window)
    return [paged_attention_ref(*args, sinks=sinks),
            paged_attention_ref(*args, key=b.key, value=b.value, sinks=sinks)]


@pytest.mark.parametrize("kind", ["moderate", "mixed"])
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", SHAPES)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("window", WINDOWS)
def test_ref_matches_hf_gpt_oss_attention_and_ignores_out_of_window_blocks(
        window, block_size, head_dim, num_heads, num_kv_heads, kind):
    batch = make_batch(REQS, head_dim, num_heads, num_kv_heads, block_size)
    hybrid = hybridise(batch, window)
    assert_hybrid_changes_something(batch, hybrid, window)
    scale, sinks = head_dim**-0.5, make_sinks(kind, num_heads)
    want = expected(batch, scale, window, sinks)
    outs = _ref_outputs(batch, scale, window, sinks)
    for got in outs:  # decode rows: the grouped float32 path over K/V padded to the longest
        assert_rows_close(got, want, 5e-6)
    assert all(torch.equal(a, b) for a, b in zip(_ref_outputs(hybrid, scale, window, sinks), outs))
    if kind == "moderate":  # the sinks bite
        plain = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.starts,
                                    batch.seq_lens, batch.table, scale, window)
        assert (plain - outs[0]).abs().max() > 1e-2


CPU_TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.usefixtures("cpu_attention_kernel")
@pytest.mark.parametrize("op", ["attention_forward", "paged_attention"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", SHAPES)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("window", [1, 7, None])
def test_cpu_ops_match_hf_gpt_oss_attention_and_ignore_out_of_window_blocks(
        window, block_size, head_dim, num_heads, num_kv_heads, dtype, op):
    batch = make_batch(REQS, head_dim, num_heads, num_kv_heads, block_size, dtype)
    hybrid = hybridise(batch, window)
    scale, sinks = head_dim**-0.5, make_sinks("mixed", num_heads)
    got = run_cpu_op(op, batch, REQS, scale, window, None, sinks)
    assert_rows_close(got, expected(batch, scale, window, sinks), CPU_TOL[dtype])
    assert torch.equal(run_cpu_op(op, hybrid, REQS, scale, window, None, sinks), got)


# chunks cpu_attention.goes_to_sdpa sends to SDPA where SDPA_FOR_LONG_CHUNKS, with and
# without cached context
LONG = [(1100, 1100), (1030, 1060), (1, 1200), (5, 90)]


@pytest.mark.usefixtures("cpu_attention_kernel")
@pytest.mark.parametrize("window", [7, None])
def test_cpu_forward_long_chunks_match_hf_gpt_oss_attention(window, monkeypatch):
    from aserve.kernels import cpu_attention
    from aserve.kernels.cpu_attention import goes_to_sdpa

    monkeypatch.setattr(cpu_attention, "SDPA_FOR_LONG_CHUNKS", True)  # (as on AMX machines)
    assert goes_to_sdpa(*np.array(LONG).T).any()
    batch = make_batch(LONG, 64, 4, 1, 16, torch.bfloat16)
    sinks = make_sinks("mixed", 4)
    got = run_cpu_op("attention_forward", batch, LONG, 0.125, window, None, sinks)
    assert_rows_close(got, expected(batch, 0.125, window, sinks), 2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [1, 7, None])
def test_cpu_forward_chunks_over_a_lowered_long_chunk_threshold_match_hf(monkeypatch, window,
                                                                          dtype,
                                                                          cpu_attention_kernel):
    """With the long-chunk threshold at 4 (as tests/models/test_cpu_block.py lowers it) every
    chunk of REQS but one goes the SDPA way (`attend_chunks`), prompts over their own rows and
    chunks over cached context alike."""
    import functools

    from aserve.kernels import cpu_attention

    calls = []

    def attend_chunks(*args, **kwargs):
        calls.append(kwargs["reqs"])
        return cpu_attention_attend_chunks(*args, **kwargs)

    cpu_attention_attend_chunks = cpu_attention.attend_chunks
    monkeypatch.setattr(cpu_attention, "plan_tiles",
                        functools.partial(cpu_attention.plan_tiles, long_chunk=4))
    monkeypatch.setattr(cpu_attention, "attend_chunks", attend_chunks)
    batch = make_batch(REQS, 64, 8, 2, 16, dtype)
    sinks = make_sinks("mixed", 8)
    got = run_cpu_op("attention_forward", batch, REQS, 0.125, window, None, sinks)
    assert_rows_close(got, expected(batch, 0.125, window, sinks), CPU_TOL[dtype])
    if cpu_attention_kernel.rows_supported(batch.q):  # else every chunk is SDPA's anyway
        assert calls == [[3, 4, 6, 7]]


# The Triton kernel under the interpreter (slow): fewer requests, over the same bounds
TRITON_REQS = [(1, 6), (1, 37), (9, 9), (3, 20), (20, 45)]


@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads,num_splits",
                         [(16, 2, 2, 1), (64, 8, 2, 3)])
# (the interpreter takes ~2 s a case: each window on one block size)
@pytest.mark.parametrize("window,block_size", [(1, 1), (7, 16), (None, 1)])
def test_triton_matches_hf_gpt_oss_attention_and_ignores_out_of_window_blocks(
        window, block_size, head_dim, num_heads, num_kv_heads, num_splits):
    run_triton = triton_attention()
    batch = make_batch(TRITON_REQS, head_dim, num_heads, num_kv_heads, block_size)
    scale, sinks = head_dim**-0.5, make_sinks("mixed", num_heads)
    got = run_triton(batch, scale, window, None, num_splits, sinks)
    assert_rows_close(got, expected(batch, scale, window, sinks), 2e-5)
    if window is not None:
        hybrid = hybridise(batch, window)
        assert_hybrid_changes_something(batch, hybrid, window)
        assert torch.equal(run_triton(hybrid, scale, window, None, num_splits, sinks), got)


@pytest.mark.parametrize("kind", ["moderate", "mixed"])
@pytest.mark.parametrize("window", [33, None])
def test_triton_split_kv_counts_each_sink_once(window, kind):
    """Long decodes cut into 1, 4 and 16 partitions (the short one's mostly empty): the reduce
    adds the sink once, whatever the number of partitions."""
    run_triton = triton_attention()
    reqs = [(1, 300), (1, 517), (1, 20)]
    batch = make_batch(reqs, 16, 4, 2, 16)
    sinks = make_sinks(kind, 4)
    want = expected(batch, 0.25, window, sinks)
    outs = [run_triton(batch, 0.25, window, None, splits, sinks) for splits in (1, 4, 16)]
    for got in outs:
        assert_rows_close(got, want, 2e-5)


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("window", [5, None])
def test_triton_bfloat16_matches_hf_gpt_oss_attention(window, num_splits):
    run_triton = triton_attention()
    batch = make_batch(TRITON_REQS, 64, 4, 1, 4, torch.bfloat16)
    sinks = make_sinks("mixed", 4)
    got = run_triton(batch, 0.125, window, None, num_splits, sinks)
    assert_rows_close(got, expected(batch, 0.125, window, sinks), 3e-2)
    assert torch.equal(run_triton(hybridise(batch, window), 0.125, window, None, num_splits,
                                  sinks), got)


def test_sinks_must_be_one_per_query_head():
    batch = make_batch([(1, 5), (3, 3)], 16, 4, 2, 4)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.starts, batch.seq_lens, batch.table,
            0.25)
    with pytest.raises(ValueError, match="sinks must be \\[4\\]"):
        paged_attention_ref(*args, sinks=torch.zeros(2))
    from aserve.kernels.paged_attention_cpu import paged_attention_cpu

    with pytest.raises(ValueError, match="sinks must be \\[4\\]"):
        paged_attention_cpu(*args, sinks=torch.zeros(4, 1))
    pytest.importorskip("triton")
    from aserve.kernels.paged_attention_triton import paged_attention_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"  # else under the interpreter
    with pytest.raises(ValueError, match="sinks must be \\[4\\]"):
        paged_attention_triton(*(x.to(device) for x in args[:-1]), 0.25, sinks=torch.zeros(8))


def _layer_steps(ops, dtype: torch.dtype, window: int | None, sinks: torch.Tensor | None):
    """An `Attention` layer bound to `ops` over two steps (prompts of 7 and 12 tokens, then a
    decode and a 3-token chunk after them); the second step's output and its HF answer."""
    from aserve.layers.attention import Attention

    hq, hkv, d, bs = 8, 2, 64, 4
    layer = Attention(hq, hkv, d, d**-0.5, sliding_window=window)
    layer.ops = ops
    layer.bind_kv_cache(torch.zeros(2, 12, bs, hkv, d, dtype=dtype))
    gen = torch.Generator().manual_seed(3)
    lens, tables = [8, 15], [[1, 2], [3, 4, 5, 6]]
    q, k, v = (torch.randn(n, h, d, generator=gen).to(dtype)
               for n, h in ((23, hq), (23, hkv), (23, hkv)))
    rows = [list(range(7)), list(range(8, 20)), [7], list(range(20, 23))]  # p0, p1, d0, c1

    def step(parts: list[list[int]], query_lens: list[int], seq_lens: list[int]):
        idx = [i for part in parts for i in part]
        m = build_metadata(query_lens, seq_lens, tables, bs)
        out = layer(q[idx].flatten(1), k[idx].flatten(1), v[idx].flatten(1), m, sinks=sinks)
        return out.view(-1, hq, d)

    step(rows[:2], [7, 12], [7, 12])
    got = step(rows[2:], [1, 3], lens)
    seqs = [rows[0] + rows[2], rows[1] + rows[3]]
    want = torch.cat([hf_sink_attention(q[s[-n:]], k[s], v[s], d**-0.5, window,
                                        torch.full((hq,), -1e4) if sinks is None else sinks)
                      for s, n in zip(seqs, (1, 3), strict=True)])
    return got, want


@pytest.mark.parametrize("window", [3, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_attention_layer_hands_its_sinks_to_the_op_that_runs(dtype, window):
    """float32: the references (store_kv + paged_attention); bf16: cpu_attention_forward;
    fp16: store_kv + the C++ decode rows."""
    from aserve.backends.cpu_ops import cpu_kernel_ops

    ops = cpu_kernel_ops(dtype)
    sinks = make_sinks("mixed", 8)
    tol = {torch.float32: 5e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    got, want = _layer_steps(ops, dtype, window, sinks)
    assert_rows_close(got, want, tol)
    got, want = _layer_steps(ops, dtype, window, None)
    assert_rows_close(got, want, tol)


def test_attention_profiling_forward_ignores_sinks():
    from aserve.layers.attention import Attention

    layer = Attention(4, 2, 16, 0.25)
    m = build_metadata([3, 5], [3, 5], [[1], [2, 3]], 4)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(8, h * 16, generator=gen) for h in (4, 2, 2))
    assert torch.equal(layer(q, k, v, m, sinks=torch.full((4,), 5.0)), layer(q, k, v, m))
