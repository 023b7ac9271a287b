"""Causal attention of a ragged batch over the paged KV cache, in Triton (CUDA and ROCm).

Same contract as `paged_attention_ref` (its oracle, in `paged_attention.py`, whose docstring
draws the cache layout and the ragged batch): one kernel serves prefill chunks and decodes
alike. The query rows of a request are cut into tiles of `BQ` tokens; a program takes one tile
and one kv head, so its rows are the tile's tokens times the G = Hq / Hkv query heads of that
kv head (padded to a power of two, then to at least 16 rows for `tl.dot`):

```
q rows:  | r0: 5 tokens      | r1: 1 | r2: 1 | r3: 3 |          BQ = 4
tiles:   | t0: 0-3 | t1: 4   | t2    | t3    | t4    | (spare tiles exit at once)
tile ids of request r: [qsl[r] // BQ + r, qsl[r+1] // BQ + r + 1)   -> found by binary search
program rows (G = 2):  token 0 head 0, token 0 head 1, token 1 head 0, ...
```

The grid is sized from host-known numbers (`T // BQ + R` tiles), so nothing is read back from
the device. A program walks its keys in tiles of 16 or 32 positions; each position finds its block
through `block_table`, so any block size works. With a sliding window the walk starts
at the first key of the tile's first query (`p - W + 1`) and reads no key before it: a hybrid
cache's blocks out of the window may be freed (the null block, or another request's). Softmax is
online, in float32.

Split-KV (flash decoding): with `num_splits > 1` the key range of every tile is cut into that
many partitions along a third grid axis; each writes its partial (max, sum, unnormalised
output) and `_reduce_kernel` combines them. `choose_num_splits` turns it on for decode-only
batches too small to fill the device over long contexts.

Attention sinks (gpt-oss: one logit per query head in every row's softmax, carrying no value):
the online softmax starts from the sink (m = sink, l = 1, acc = 0) instead of (-inf, 0, 0);
with split-KV the partitions leave it out and the reduce counts it once, in its max and sum.

Not here: quantised caches, ALiBi.
"""

from __future__ import annotations

import functools

import torch

from aserve.kernels.paged_attention import checked_sinks, paged_attention_ref
from aserve.kernels.triton_utils import (
    FLOAT_DTYPES,
    check_float,
    is_interpreted,
    next_pow2,
    require_triton,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # the module still imports; the launcher says what is missing
    triton = None

__all__ = ["choose_num_splits", "paged_attention_ref", "paged_attention_triton"]

_MIN_SPLIT_TOKENS = 256  # a partition shorter than this is not worth its reduce
_MAX_SPLITS = 16

if triton is not None:
    _TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16,
                  torch.bfloat16: tl.bfloat16}

    @triton.jit
    def _tanh(x):
        e = tl.exp(-2.0 * tl.abs(x))  # in (0, 1]: no overflow
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x >= 0, t, -t)

    @triton.jit
    def _find_request(qsl_ptr, num_reqs, tile_id, BQ: tl.constexpr):
        """The last request whose first tile id `qsl[r] // BQ + r` is <= tile_id."""
        lo = num_reqs * 0
        hi = num_reqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if tl.load(qsl_ptr + mid) // BQ + mid <= tile_id:
                lo = mid
            else:
                hi = mid - 1
        return lo

    @triton.jit
    def _attend_tile(acc, m_i, l_i, q, pos, req, kv_head, t, kv_start, kv_end, k_ptr, v_ptr,
                     table_ptr, scale, soft_cap, window, stride_table, block_size, stride_kb,
                     stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, HEAD_DIM: tl.constexpr,
                     D_PAD: tl.constexpr, TILE_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                     HAS_CAP: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
        """One online-softmax step over key positions [t * TILE_N, (t + 1) * TILE_N); keys
        outside [kv_start, kv_end) are not read (with a window, the blocks before kv_start may
        be freed: the null block or another request's)."""
        k_pos = t * TILE_N + tl.arange(0, TILE_N)  # [TILE_N]
        dims = tl.arange(0, D_PAD)  # [D_PAD]
        key_ok = (k_pos >= kv_start) & (k_pos < kv_end)
        blk = tl.load(table_ptr + req * stride_table + k_pos // block_size, mask=key_ok, other=0)
        off = k_pos % block_size
        k_off = blk.to(tl.int64) * stride_kb + off * stride_ks + kv_head * stride_kh  # [TILE_N]
        v_off = blk.to(tl.int64) * stride_vb + off * stride_vs + kv_head * stride_vh  # [TILE_N]
        kv_mask = key_ok[None, :] & (dims[:, None] < HEAD_DIM)  # [D_PAD, TILE_N]
        k = tl.load(k_ptr + k_off[None, :] + dims[:, None], mask=kv_mask, other=0.0)
        s = tl.dot(q, k.to(DOT_DTYPE), input_precision=PRECISION) * scale  # [BLOCK_M, TILE_N]
        if HAS_CAP:
            s = soft_cap * _tanh(s / soft_cap)
        allowed = key_ok[None, :] & (k_pos[None, :] <= pos[:, None])
        if HAS_WINDOW:
            allowed = allowed & (k_pos[None, :] > pos[:, None] - window)
        s = tl.where(allowed, s * 1.4426950408889634, float("-inf"))  # log2 domain
        m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, TILE_N]
        alpha = tl.exp2(m_i - m_new)  # [BLOCK_M]
        v = tl.load(v_ptr + v_off[:, None] + dims[None, :], mask=tl.trans(kv_mask), other=0.0)
        pv = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
        return acc * alpha[:, None] + pv, m_new, l_i * alpha + tl.sum(p, 1)

    @triton.jit
    def _attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, qsl_ptr, seq_lens_ptr, table_ptr,
                          sinks_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, num_reqs, scale,
                          soft_cap, window, stride_qt, stride_qh, stride_ot, stride_oh,
                          stride_table, block_size, stride_kb, stride_ks, stride_kh, stride_vb,
                          stride_vs, stride_vh, G: tl.constexpr, G_PAD: tl.constexpr,
                          BQ: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                          D_PAD: tl.constexpr, TILE_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                          HAS_CAP: tl.constexpr, SPLIT: tl.constexpr, HAS_SINKS: tl.constexpr,
                          DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
        tile_id, kv_head = tl.program_id(0), tl.program_id(1)
        req = _find_request(qsl_ptr, num_reqs, tile_id, BQ)
        q_start = tl.load(qsl_ptr + req)
        q_len = tl.load(qsl_ptr + req + 1) - q_start
        first = (tile_id - q_start // BQ - req) * BQ  # the tile's first token in its request
        if first >= q_len:
            return
        context = tl.load(seq_lens_ptr + req) - q_len
        rows = tl.arange(0, BLOCK_M)  # [BLOCK_M]: token rows // G_PAD, head rows % G_PAD
        tok = first + rows // G_PAD  # [BLOCK_M]
        head = kv_head * G + rows % G_PAD  # [BLOCK_M]
        row_ok = (rows < BQ * G_PAD) & (rows % G_PAD < G) & (tok < q_len)
        dims = tl.arange(0, D_PAD)
        io_mask = row_ok[:, None] & (dims[None, :] < HEAD_DIM)  # [BLOCK_M, D_PAD]
        q_row = (q_start + tok).to(tl.int64)
        q = tl.load(q_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh
                    + dims[None, :], mask=io_mask, other=0.0).to(DOT_DTYPE)
        kv_end = context + tl.minimum(first + BQ, q_len)  # keys past the tile's last query: none
        kv_start = 0
        if HAS_WINDOW:
            kv_start = tl.maximum(context + first - window + 1, 0)
        lo, hi = kv_start // TILE_N, tl.cdiv(kv_end, TILE_N)
        if SPLIT:
            per = tl.cdiv(hi - lo, tl.num_programs(2))
            lo = lo + tl.program_id(2) * per
            hi = tl.minimum(hi, lo + per)
        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], -1e30, dtype=tl.float32)  # finite: a masked tile gives 0, not NaN
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        if HAS_SINKS and not SPLIT:  # start from the sink's logit: weight exp(0) = 1, no value
            m_i = tl.load(sinks_ptr + head, mask=row_ok, other=0.0) * 1.4426950408889634
            l_i = l_i + 1.0
        pos = context + tok  # [BLOCK_M] query positions
        for t in range(lo, hi):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, pos, req, kv_head, t, kv_start, kv_end, k_ptr, v_ptr, table_ptr,
                scale, soft_cap, window, stride_table, block_size, stride_kb, stride_ks,
                stride_kh, stride_vb, stride_vs, stride_vh, HEAD_DIM, D_PAD, TILE_N, HAS_WINDOW,
                HAS_CAP, DOT_DTYPE, PRECISION)
        _write_result(acc, m_i, l_i, q_row, head, row_ok, out_ptr, part_acc_ptr, part_max_ptr,
                      part_sum_ptr, stride_ot, stride_oh, G, HEAD_DIM, D_PAD, SPLIT)

    @triton.jit
    def _write_result(acc, m_i, l_i, q_row, head, row_ok, out_ptr, part_acc_ptr, part_max_ptr,
                      part_sum_ptr, stride_ot, stride_oh, G: tl.constexpr,
                      HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLIT: tl.constexpr):
        """The normalised rows into out, or this partition's (max, sum, acc) for the reduce."""
        dims = tl.arange(0, D_PAD)
        io_mask = row_ok[:, None] & (dims[None, :] < HEAD_DIM)  # [BLOCK_M, D_PAD]
        if SPLIT:
            num_splits = tl.num_programs(2)
            num_heads = G * tl.num_programs(1)
            part = (q_row * num_heads + head) * num_splits + tl.program_id(2)  # into [T, Hq, S]
            tl.store(part_max_ptr + part, m_i, mask=row_ok)
            tl.store(part_sum_ptr + part, l_i, mask=row_ok)
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=io_mask)
        else:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh
                     + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask)

    @triton.jit
    def _reduce_kernel(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, qsl_ptr, sinks_ptr,
                       num_reqs, num_splits, stride_ot, stride_oh, HEAD_DIM: tl.constexpr,
                       D_PAD: tl.constexpr, S_PAD: tl.constexpr, HAS_SINKS: tl.constexpr):
        """out[t, h] from the partitions of row t, head h: rescale each to the common max (with
        sinks, the sink joins the max and the sum here, once)."""
        row, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
        if row >= tl.load(qsl_ptr + num_reqs):
            return  # a padding row: no partials were written
        splits, dims = tl.arange(0, S_PAD), tl.arange(0, D_PAD)
        base = (row * tl.num_programs(1) + head) * num_splits
        ok = splits < num_splits
        m = tl.load(part_max_ptr + base + splits, mask=ok, other=float("-inf"))  # [S_PAD]
        sums = tl.load(part_sum_ptr + base + splits, mask=ok, other=0.0)  # [S_PAD]
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + head) * 1.4426950408889634  # log2 domain
            top = tl.maximum(tl.max(m, 0), sink)
            w = tl.exp2(m - top)  # [S_PAD]
            total = tl.sum(w * sums, 0) + tl.exp2(sink - top)
        else:
            w = tl.exp2(m - tl.max(m, 0))  # [S_PAD]
            total = tl.sum(w * sums, 0)
        acc = tl.load(part_acc_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :],
                      mask=ok[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)  # [S_PAD, D_PAD]
        out = tl.sum(w[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)  # [D_PAD]
        tl.store(out_ptr + row * stride_ot + head * stride_oh + dims,
                 out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)
else:  # no triton: the launchers raise require_triton's RuntimeError
    _attention_kernel = _reduce_kernel = None


def choose_num_splits(max_query_len: int, num_reqs: int, num_kv_heads: int, max_seq_len: int,
                      num_sms: int) -> int:
    """Key partitions per tile: 1 (no split) unless the batch is all decodes, its
    (request, kv head) programs are fewer than the device's SMs, and contexts are long; then
    enough partitions of at least `_MIN_SPLIT_TOKENS` keys to give ~2 programs per SM."""
    programs = num_reqs * num_kv_heads
    if max_query_len != 1 or programs >= num_sms:
        return 1
    by_length = max_seq_len // _MIN_SPLIT_TOKENS
    by_device = -(-2 * num_sms // programs)
    return max(1, min(_MAX_SPLITS, by_length, by_device))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 16  # the interpreter: any number will do
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                  block_table: torch.Tensor, out: torch.Tensor | None) -> None:
    name = "paged_attention_triton"
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"{name}: q must be [T, Hq, D] and k/v caches both [NB, BS, Hkv, D], "
                         f"got {tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}.")
    if k_cache.shape[3] != q.shape[2] or q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"{name}: {q.shape[1]} query heads of size {q.shape[2]} do not group "
                         f"onto {k_cache.shape[2]} kv heads of size {k_cache.shape[3]}.")
    if out is not None and (out.shape != q.shape or out.dtype not in FLOAT_DTYPES):
        raise ValueError(f"{name}: out must be like q {tuple(q.shape)}, got {tuple(out.shape)}.")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"{name}: q and the caches must share a dtype, got {q.dtype}, "
                         f"{k_cache.dtype}, {v_cache.dtype}.")
    check_float(name, q=q, k_cache=k_cache, v_cache=v_cache, out=q if out is None else out)
    num_reqs = seq_lens.shape[0]
    for arg, x, shape in (("query_start_loc", query_start_loc, (num_reqs + 1,)),
                          ("seq_lens", seq_lens, (num_reqs,))):
        if x.dtype not in (torch.int32, torch.int64) or tuple(x.shape) != shape or (
                x.numel() > 1 and x.stride(0) != 1):
            raise ValueError(f"{name}: {arg} must be a contiguous int32/int64 {list(shape)}, "
                             f"got {x.dtype} {tuple(x.shape)}.")
    if block_table.dim() != 2 or block_table.shape[0] < num_reqs or block_table.stride(1) != 1:
        raise ValueError(f"{name}: block_table must be [R={num_reqs}, M] with unit column "
                         f"stride, got {tuple(block_table.shape)}.")
    if block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: block_table must be int32/int64, got {block_table.dtype}.")


def _max_query_len(num_tokens: int, num_reqs: int, query_start_loc_cpu: list[int] | None) -> int:
    """From the host copy when given, else the bound `T - R + 1` (every request has a row)."""
    if query_start_loc_cpu is not None:
        return max(b - a for a, b in zip(query_start_loc_cpu, query_start_loc_cpu[1:]))
    return max(1, num_tokens - num_reqs + 1)


def _tile_shape(num_tokens: int, num_reqs: int, max_query_len: int, group: int,
                head_dim: int, block_size: int, is_fp32: bool) -> tuple[int, int, int, int]:
    """(BQ tokens per tile, BLOCK_M rows, TILE_N keys, num_warps).

    64-row tiles for prefill-heavy batches, 16-row ones where decodes dominate (a decode's tile
    wastes every row but its own). Head size 256 and float32 (whose exact dots run on FMA
    units) get smaller tiles, and big tiles 8 warps: the register counts of sm_90 builds stay
    under 255 with no spills that way.
    """
    g_pad, d_pad = next_pow2(group), next_pow2(head_dim)
    small = d_pad >= 256 or is_fp32
    rows = min(64 if num_tokens >= 4 * num_reqs else 16, 32 if small else 64)
    bq = max(1, min(rows // g_pad, next_pow2(max_query_len)))
    block_m = max(16, bq * g_pad)
    tile_n = 16 if small else min(max(16, next_pow2(block_size)), 32)
    return bq, block_m, tile_n, 8 if block_m * d_pad >= 4096 else 4


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                           block_table: torch.Tensor, scale: float,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           out: torch.Tensor | None = None, *,
                           query_start_loc_cpu: list[int] | None = None,
                           seq_lens_cpu: list[int] | None = None,
                           key: torch.Tensor | None = None, value: torch.Tensor | None = None,
                           sinks: torch.Tensor | None = None,
                           num_splits: int | None = None) -> torch.Tensor:
    """Attention of q [T, Hq, D] over the paged caches [NB, BS, Hkv, D]; returns [T, Hq, D].

    The contract of `paged_attention_ref`. The host lists only steer the tiling (never read
    back from the device otherwise); `key` / `value` are ignored: this step's rows are read
    from the cache, where they already are. `sinks` [Hq] float32 or None, as in the reference.
    `num_splits` forces the split-KV partitions (1: none); None lets `choose_num_splits`
    decide. Padding rows of `out` are left untouched.
    """
    require_triton("paged_attention_triton", _attention_kernel, q, k_cache, v_cache)
    _check_inputs(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, out)
    sinks = checked_sinks("paged_attention_triton", sinks, q)
    out = torch.zeros_like(q) if out is None else out
    num_tokens, num_heads, head_dim = q.shape
    num_reqs, num_kv_heads = seq_lens.shape[0], k_cache.shape[2]
    if num_reqs == 0 or num_tokens == 0:
        return out
    max_q = _max_query_len(num_tokens, num_reqs, query_start_loc_cpu)
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"paged_attention_triton: num_splits must be >= 1, got {num_splits}.")
    if num_splits is None:
        max_seq = max(seq_lens_cpu) if seq_lens_cpu else block_table.shape[1] * k_cache.shape[1]
        num_splits = choose_num_splits(max_q, num_reqs, num_kv_heads, max_seq, _num_sms(q.device))
    group = num_heads // num_kv_heads
    bq, block_m, tile_n, num_warps = _tile_shape(num_tokens, num_reqs, max_q, group, head_dim,
                                                 k_cache.shape[1], q.dtype == torch.float32)
    parts = _partials(q, num_splits)
    # the interpreter's bfloat16 dot is wrong (see is_interpreted); float16 runs as on the GPU
    dot_fp32 = q.dtype == torch.float32 or (
        q.dtype == torch.bfloat16 and is_interpreted(_attention_kernel))
    grid = (num_tokens // bq + num_reqs, num_kv_heads, num_splits)
    sinks_arg = q if sinks is None else sinks  # a stand-in pointer, never read without sinks
    _attention_kernel[grid](
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table, sinks_arg, *parts,
        num_reqs, float(scale), float(soft_cap or 0.0), int(sliding_window or 0), q.stride(0),
        q.stride(1), out.stride(0), out.stride(1), block_table.stride(0), k_cache.shape[1],
        *k_cache.stride()[:3], *v_cache.stride()[:3], G=group, G_PAD=next_pow2(group), BQ=bq,
        BLOCK_M=block_m, HEAD_DIM=head_dim, D_PAD=next_pow2(head_dim), TILE_N=tile_n,
        HAS_WINDOW=sliding_window is not None, HAS_CAP=soft_cap is not None,
        SPLIT=num_splits > 1, HAS_SINKS=sinks is not None,
        DOT_DTYPE=tl.float32 if dot_fp32 else _TL_DTYPES[q.dtype],
        PRECISION="ieee" if q.dtype == torch.float32 else None, num_warps=num_warps)
    if num_splits > 1:
        _reduce_kernel[(num_tokens, num_heads)](
            out, *parts, query_start_loc, sinks_arg, num_reqs, num_splits, out.stride(0),
            out.stride(1), HEAD_DIM=head_dim, D_PAD=next_pow2(head_dim),
            S_PAD=next_pow2(num_splits), HAS_SINKS=sinks is not None)
    return out


def _partials(q: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, ...]:
    """Float32 (acc [T, Hq, S, D], max [T, Hq, S], sum [T, Hq, S]) for split-KV; stand-ins
    (never written) without it."""
    if num_splits <= 1:
        return q, q, q
    t, h, d = q.shape
    acc = torch.empty(t, h, num_splits, d, dtype=torch.float32, device=q.device)
    stats = torch.empty(2, t, h, num_splits, dtype=torch.float32, device=q.device)
    return acc, stats[0], stats[1]
