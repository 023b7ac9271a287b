"""The C++ CPU decode kernel against its oracle, `paged_attention_ref`, over a grid of shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.attention import MIXED, expected, make_batch

from aserve.kernels.paged_attention import paged_attention_ref
from aserve.kernels.paged_attention_cpu import load_kernel, paged_attention_cpu

pytestmark = pytest.mark.usefixtures("cpu_attention_kernel")  # built when the first test runs

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


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (16, 2, 80), (4, 4, 32)])
def test_a_row_attends_to_the_same_bits_alone_and_among_many(num_heads, num_kv_heads,
                                                               head_dim):
    """A call of many tiles runs each task over all of a tile's kv heads, one of a few tiles a
    task per kv head (AVX2): each decode row's output must be the same bits either way."""
    from aserve.kernels.cpu_attention import plan_tiles

    if not _row_tiles(num_heads, head_dim):
        pytest.skip("the row-tile kernel is not built here")
    gen = torch.Generator().manual_seed(3)
    bs, per_req, num_reqs = 16, 12, 8
    kc = torch.randn(num_reqs * per_req, bs, num_kv_heads, head_dim, generator=gen).bfloat16()
    vc = torch.randn(kc.shape, generator=gen).bfloat16()
    table = torch.arange(num_reqs * per_req, dtype=torch.int32).reshape(num_reqs, per_req)
    table = table[torch.randperm(num_reqs, generator=gen)].contiguous()
    lens = np.array([37 + 19 * r for r in range(num_reqs)])
    starts = np.arange(num_reqs + 1)
    q = torch.randn(num_reqs, num_heads, head_dim, generator=gen).bfloat16()
    kernel, scale = load_kernel(), head_dim**-0.5
    tiles, _ = plan_tiles(starts, lens)
    together = torch.zeros_like(q)
    kernel.attend_rows(q, kc, vc, table, tiles, together, scale, 0, 0.0, None)
    for r in (0, 5):
        alone = torch.zeros_like(q)
        kernel.attend_rows(q, kc, vc, table, tiles[tiles[:, 0] == r].contiguous(), alone,
                           scale, 0, 0.0, None)
        assert torch.equal(alone[r], together[r])
    want = expected(q.double(), torch.from_numpy(starts), [
        kc[table[r].long()].flatten(0, 1)[:lens[r]].double() for r in range(num_reqs)], [
        vc[table[r].long()].flatten(0, 1)[:lens[r]].double() for r in range(num_reqs)],
        scale, None, None)
    torch.testing.assert_close(together.double(), want, atol=2e-2, rtol=2e-2)


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


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", [576, 100])  # 100: a tail past whole vectors
def test_fused_rms_norm_matches_the_torch_formulation(rows, with_residual, hidden):
    from aserve.kernels import cpu_elementwise

    if not cpu_elementwise.load():
        pytest.skip("no C++ toolchain")
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=gen).bfloat16()
    residual = torch.randn(rows, hidden, generator=gen).bfloat16() if with_residual else None
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).bfloat16()
    got_x, want_x = x.clone(), x.clone()
    got_r = residual.clone() if with_residual else None
    want_r = residual.clone() if with_residual else None
    cpu_elementwise.rms_norm(got_x, w, 1e-5, got_r)
    cpu_elementwise.rms_norm_ref(want_x, w, 1e-5, want_r)
    if with_residual:
        assert torch.equal(got_r, want_r)
    # float32 sums in another order: at most one bf16 step apart, in very few elements
    torch.testing.assert_close(got_x, want_x, atol=2e-2, rtol=1e-2)
    assert (got_x != want_x).float().mean() < 1e-3


@pytest.mark.parametrize("rotary_dim", [64, 32, 20])  # 20: halves of 10, a tail past 8 lanes
def test_fused_rope_on_strided_rows_is_bit_equal(rotary_dim):
    from aserve.kernels import cpu_elementwise
    from aserve.layers.rotary import get_rope

    if not cpu_elementwise.load():
        pytest.skip("no C++ toolchain")
    rope = get_rope(64, rotary_dim, 256, 10000.0, None, torch.bfloat16)
    positions = torch.randint(0, 256, (33,))
    qkv = torch.randn(33, 9 * 64 + 2 * 3 * 64).bfloat16()
    q = qkv[:, :576]  # strided rows, as split from the fused qkv projection
    want = q.clone()
    cpu_elementwise.rope_ref(positions, want, rope.cos_cache, rope.sin_cache, 64, rotary_dim)
    cpu_elementwise.rope(positions, q, rope.cos_cache, rope.sin_cache, 64, rotary_dim)
    assert torch.equal(q, want)


def test_cpu_rope_op_on_q_and_k_of_one_qkv_row_equals_each_alone():
    from aserve.backends.cpu_ops import rope as op
    from aserve.kernels import cpu_elementwise
    from aserve.layers.rotary import get_rope

    if not cpu_elementwise.load():
        pytest.skip("no C++ toolchain")
    rope = get_rope(64, 64, 256, 10000.0, None, torch.bfloat16)
    positions = torch.randint(0, 256, (21,))
    qkv = torch.randn(21, 9 * 64 + 2 * 3 * 64).bfloat16()
    q, k, _ = qkv.split([576, 192, 192], dim=-1)  # adjacent: one pass over both
    q2, k2 = q.clone(), k.clone()  # apart: a pass each
    op(positions, q, k, rope.cos_cache, rope.sin_cache, 64, 64)
    op(positions, q2, k2, rope.cos_cache, rope.sin_cache, 64, 64)
    assert torch.equal(q, q2) and torch.equal(k, k2)
    want_v = qkv[:, 768:].clone()  # v, right after k in the row, is left alone
    op(positions, q, k, rope.cos_cache, rope.sin_cache, 64, 64)
    assert torch.equal(qkv[:, 768:], want_v)


def test_fused_silu_and_mul_is_bit_equal():
    from aserve.kernels import cpu_elementwise

    if not cpu_elementwise.load():
        pytest.skip("no C++ toolchain")
    x = torch.randn(17, 2 * 1536).bfloat16()
    assert torch.equal(cpu_elementwise.silu_and_mul(x), cpu_elementwise.silu_and_mul_ref(x))



@pytest.mark.parametrize("limit", [None, 7.0, 1.5])
def test_fused_swiglu_oai_and_mul_is_bit_equal_but_where_a_subnormal_flushes(limit):
    """Over every bf16 gate value: torch's bf16 ops to the bit, but where the sigmoid (gate <
    -51), gate * sigmoid (about gate / 2) or the result is a float subnormal, which the
    AVX512-BF16 rounding flushes to zero."""
    from aserve.kernels import cpu_elementwise

    if not cpu_elementwise.load():
        pytest.skip("no C++ toolchain")
    gate = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gate = gate.reshape(256, 256)
    up = (3 * torch.randn(gate.shape, generator=torch.Generator().manual_seed(0))).bfloat16()
    x = torch.cat([gate, up], dim=-1)
    got = cpu_elementwise.swiglu_oai_and_mul(x, limit=limit)
    want = cpu_elementwise.swiglu_oai_and_mul_ref(x, limit=limit)
    off = (got.view(torch.int16) != want.view(torch.int16)) & ~(got.isnan() & want.isnan())
    tiny = torch.finfo(torch.float32).tiny
    subnormal = ((torch.sigmoid(1.702 * gate.float()) < tiny) | (gate.float().abs() < 4 * tiny)
                 | (want.float().abs() < tiny))
    flushed = (got == 0) & subnormal
    assert not (off & ~flushed).any(), gate[off & ~flushed][:8]
    assert off.sum() < 1024

def _forward_case(reqs, num_heads, num_kv_heads, head_dim, block_size, window=None,
                  soft_cap=None, seed=0, q_row_pad=0):
    """cpu_attention_forward on a batch whose new rows' K/V are NOT yet in the cache (zeroed
    there), against dense float64 attention over the true K/V. `q_row_pad`: q's rows are
    strided, that many heads apart more than contiguous rows (as q of a qkv projection)."""
    from aserve.kernels.cpu_attention import cpu_attention_forward
    from aserve.layers.attention import AttentionMetadata

    q, kc, vc, starts, lens, table, keys, values = make_batch(
        reqs, num_heads, num_kv_heads, head_dim, block_size, dtype=torch.bfloat16, seed=seed)
    keys = [k.bfloat16() for k in keys]
    values = [v.bfloat16() for v in values]
    slots, new_k, new_v = [], [], []
    for r, (q_len, seq_len) in enumerate(reqs):
        for pos in range(seq_len - q_len, seq_len):
            block = int(table[r, pos // block_size])
            slots.append(block * block_size + pos % block_size)
            kc[block, pos % block_size] = 0
            vc[block, pos % block_size] = 0
        new_k.append(keys[r][seq_len - q_len:])
        new_v.append(values[r][seq_len - q_len:])
    # the new K/V rows as strided views of one fused projection, as the model produces them
    fused = torch.cat([torch.cat(new_k), torch.cat(new_v)], dim=1)  # [T, 2 * Hkv, D]
    key, value = fused[:, :num_kv_heads], fused[:, num_kv_heads:]
    meta = AttentionMetadata(starts, lens, table.clamp(min=0), torch.tensor(slots),
                             max(q for q, _ in reqs), max(s for _, s in reqs),
                             starts.tolist(), lens.tolist())
    scale = head_dim**-0.5
    if q_row_pad:
        q = torch.cat([q, torch.ones(q.shape[0], q_row_pad, head_dim).bfloat16()], dim=1)
        q = q[:, :num_heads]
    got = cpu_attention_forward(q, key, value, kc, vc, meta, scale, window, soft_cap)
    want = expected(q.double(), starts, [k.double() for k in keys],
                    [v.double() for v in values], scale, window, soft_cap)
    return got, want, meta


def _row_tiles(num_heads: int, head_dim: int) -> bool:
    """Whether this build runs the row-tile kernel (AVX-512) rather than the fallback."""
    return load_kernel().rows_supported(torch.empty(1, num_heads, head_dim, dtype=torch.bfloat16))


LONG = [(1100, 1100), (1, 1200), (1030, 1060)]  # chunks SDPA takes on AMX (goes_to_sdpa)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4), (16, 1), (8, 2)])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 16), (80, 32), (16, 4)])
def test_cpu_forward_stores_and_attends_every_row(num_heads, num_kv_heads, head_dim,
                                                  block_size):
    got, want, meta = _forward_case(MIXED + DECODES + [(9, 9), (8, 30), (17, 17)], num_heads,
                                    num_kv_heads, head_dim, block_size)
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
    if _row_tiles(num_heads, head_dim):
        assert meta.kernel_plan is not None  # planned once, for the next layers


@pytest.mark.parametrize("window,soft_cap", [(5, None), (1, None), (None, 2.0), (8, 3.0)])
def test_cpu_forward_sliding_window_and_soft_cap(window, soft_cap):
    got, want, _ = _forward_case(MIXED + DECODES, 8, 2, 64, 4, window, soft_cap)
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)


def test_cpu_forward_long_chunks_and_reused_plan(monkeypatch):
    from aserve.kernels import cpu_attention
    from aserve.kernels.cpu_attention import goes_to_sdpa

    monkeypatch.setattr(cpu_attention, "SDPA_FOR_LONG_CHUNKS", True)  # (as on AMX machines)
    assert goes_to_sdpa(*np.array(LONG).T).any()
    got, want, meta = _forward_case(LONG + DECODES, 9, 3, 64, 16)
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
    if _row_tiles(9, 64):
        assert meta.kernel_plan[1] == [0, 2]  # the long chunks, by request


def test_cpu_forward_reads_strided_q_rows_as_contiguous_ones():
    contiguous, want, _ = _forward_case(MIXED + DECODES, 9, 3, 64, 16)
    strided, _, _ = _forward_case(MIXED + DECODES, 9, 3, 64, 16, q_row_pad=6)
    assert torch.equal(strided, contiguous)
    torch.testing.assert_close(strided.double(), want, atol=2e-2, rtol=2e-2)


def test_cpu_store_kv_skips_padding_slots():
    from aserve.kernels.paged_attention_cpu import load_kernel as kernel
    from aserve.kernels.store_kv import store_kv_ref

    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(6, 2 * 3, 16, generator=gen).bfloat16()
    key, value = kv[:, :3], kv[:, 3:]
    slots = torch.tensor([5, -1, 0, 17, -1, 9])
    got = [torch.zeros(5, 4, 3, 16, dtype=torch.bfloat16) for _ in range(2)]
    want = [torch.zeros(5, 4, 3, 16, dtype=torch.bfloat16) for _ in range(2)]
    kernel().store_kv(key, value, *got, slots)
    store_kv_ref(key, value, *want, slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[0].count_nonzero() == 4 * 3 * 16  # four rows written, the padding ones not


@pytest.fixture(params=["vector", "amx"])
def gemm_tiles(request):
    """Each GEMM test on both kinds of tiles: the vector tiles everywhere, AMX where the CPU
    has it (skipped elsewhere)."""
    from aserve.kernels import cpu_gemm

    if not cpu_gemm.available():
        pytest.skip("no packed GEMM build here (AVX512-BF16 or AVX2)")
    if request.param == "amx" and not cpu_gemm.amx():
        pytest.skip("no AMX tiles here")
    cpu_gemm.amx(request.param == "amx")
    yield request.param
    cpu_gemm.amx(True)


@pytest.mark.parametrize("rows,out_features,in_features", [
    (1, 5, 2), (7, 48, 64), (8, 96, 576), (13, 1000, 576), (64, 3072, 576), (70, 50, 34),
    (130, 49, 1536), (17, 100, 64), (79, 48, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_cpu_gemm_matches_float32_matmul_to_one_bf16_step(rows, out_features, in_features,
                                                          with_bias, gemm_tiles):
    from aserve.kernels import cpu_gemm

    if not cpu_gemm.available():
        pytest.skip("no packed GEMM build here (AVX512-BF16 or AVX2)")
    gen = torch.Generator().manual_seed(rows * out_features)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    w = torch.randn(out_features, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if with_bias else None
    got = cpu_gemm.PackedWeight(w).linear(x, b).float()
    exact = x.double() @ w.double().T + (b.double() if with_bias else 0)
    # float32 sums in another order, then one rounding to bf16: within one bf16 step
    step = exact.abs().clamp(min=2.0**-126) * 2.0**-7
    assert torch.all((got.double() - exact).abs() <= step + 1e-3 * exact.abs().max())


def test_cpu_gemm_keeps_leading_dims_and_reads_strided_rows(gemm_tiles):
    from aserve.kernels import cpu_gemm

    if not cpu_gemm.available():
        pytest.skip("no packed GEMM build here (AVX512-BF16 or AVX2)")
    w = torch.randn(40, 64).bfloat16()
    x = torch.randn(3, 5, 128).bfloat16()[..., :64]  # strided rows
    got = cpu_gemm.PackedWeight(w).linear(x)
    assert got.shape == (3, 5, 40)
    torch.testing.assert_close(got.float(), (x.float() @ w.float().T), atol=0.1, rtol=0.02)


@pytest.mark.parametrize("rows,out_features,in_features",
                         [(1, 49152, 576), (9, 100, 64), (70, 50, 34)])
def test_cpu_gemm_float_output_is_the_bf16_result_widened(rows, out_features, in_features,
                                                          gemm_tiles):
    from aserve.kernels import cpu_gemm

    if not cpu_gemm.available():
        pytest.skip("no packed GEMM build here (AVX512-BF16 or AVX2)")
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    w = torch.randn(out_features, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16()
    packed = cpu_gemm.PackedWeight(w)
    for bias in (None, b):
        got = packed.linear_float(x, bias)
        assert got.dtype == torch.float32
        assert torch.equal(got, packed.linear(x, bias).float())


@pytest.mark.parametrize("rows,d,in_features", [
    (1, 1536, 576), (9, 50, 128), (64, 1536, 576), (70, 24, 34), (100, 40, 64)])
def test_cpu_gemm_gated_pack_is_bit_equal_to_plain_gemm_then_silu_and_mul(rows, d, in_features,
                                                                          gemm_tiles):
    from aserve.kernels import cpu_elementwise, cpu_gemm

    if not cpu_gemm.available():
        pytest.skip("no packed GEMM build here (AVX512-BF16 or AVX2)")
    gen = torch.Generator().manual_seed(rows + d)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    w = (torch.randn(2 * d, in_features, generator=gen) * 0.1).bfloat16()  # [gate; up]
    plain, gated = cpu_gemm.PackedWeight(w), cpu_gemm.PackedWeight(w, gated=True)
    gate_up = plain.linear(x)
    assert torch.equal(gated.linear(x), gate_up)  # the gated panels un-permuted on store
    fused = gated.silu_and_mul(x)
    assert fused.shape == (rows, d)
    assert torch.equal(fused, cpu_elementwise.silu_and_mul(gate_up))
    # and what that is: torch's bf16 silu(gate) * up
    assert torch.equal(fused, cpu_elementwise.silu_and_mul_ref(gate_up))


def test_cpu_gemm_fused_silu_is_torchs_over_every_finite_bf16_gate(gemm_tiles):
    """One-hot rows make each gate_up sum one weight exactly, so the 65,536 gates of a
    [256, 256] gate half are every bf16 value (infinities and NaNs left out), in order along
    each row (a vector's lanes hold neighbouring values): the fused epilogue's vector silu
    (exp8 / exp16) is torch's bf16 silu(gate) * up to the bit, the gates below -88 (where
    exp8 clamps) included."""
    from aserve.kernels import cpu_elementwise, cpu_gemm

    if not cpu_gemm.available():
        pytest.skip("no packed GEMM build here (AVX512-BF16 or AVX2)")
    gates = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gates = torch.where(gates.float().isfinite(), gates, torch.zeros_like(gates))
    up = (torch.randn(256, 256, generator=torch.Generator().manual_seed(0)) + 1).bfloat16()
    w = torch.cat([gates.reshape(256, 256).t(), up])  # [gate; up] x 256 in_features
    x = torch.eye(256).bfloat16()
    gate_up = cpu_gemm.PackedWeight(w).linear(x)
    assert torch.equal(gate_up, w.t())  # each sum is the one weight
    fused = cpu_gemm.PackedWeight(w, gated=True).silu_and_mul(x)
    assert torch.equal(fused, cpu_elementwise.silu_and_mul_ref(gate_up))

@pytest.mark.parametrize("rows", [1, 5, 16, 17, 64, 65, 200])
def test_amx_tiles_agree_with_the_vector_tiles_row_by_row(rows):
    """AMX rounds its sums its own way (most outputs bit-equal to the vector tiles', some one
    bf16 step apart), and a row's result does not depend on the rows beside it (a tail group
    recomputes rows it does not store)."""
    from aserve.kernels import cpu_gemm

    if not cpu_gemm.available() or not cpu_gemm.amx():
        pytest.skip("no AMX tiles here")
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    w = cpu_gemm.PackedWeight(torch.randn(200, 576, generator=gen).bfloat16())
    amx = w.linear(x)
    assert torch.equal(torch.cat([w.linear(x[i:i + 1]) for i in range(rows)]), amx)
    try:
        cpu_gemm.amx(False)
        vector = w.linear(x)
    finally:
        cpu_gemm.amx(True)
    step = vector.float().abs().clamp(min=2.0**-126) * 2.0**-7
    assert torch.all((amx.float() - vector.float()).abs() <= step)


def test_cpu_gemm_weights_gathered_in_huge_pages_compute_the_same(gemm_tiles):
    from aserve.kernels.cpu_gemm import PackedWeight, available, gather_in_huge_pages

    if not available():
        pytest.skip("aserve's AVX512-BF16 GEMM is not built here")
    torch.manual_seed(0)
    weights = [PackedWeight(torch.randn(n, 576).bfloat16(), gated=gated)
               for n, gated in ((3072, True), (960, False), (8192, False))]
    x = torch.randn(5, 576).bfloat16()

    def outputs() -> list[torch.Tensor]:
        return [w.silu_and_mul(x) if w.gated else w.linear(x) for w in weights]

    before, packed = outputs(), [w.data.clone() for w in weights]
    buffer = gather_in_huge_pages(weights)
    assert all(torch.equal(w.data, p) for w, p in zip(weights, packed, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(outputs(), before, strict=True))
    if buffer is not None:  # Linux granted huge pages: every weight now lives in the buffer
        start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
        assert all(start <= w.data.data_ptr() < end and w.data.data_ptr() % 64 == 0
                   for w in weights)


def test_cpu_argmax_equals_torch_including_ties_infinities_and_nan():
    from aserve.kernels import cpu_elementwise

    if not cpu_elementwise.load():
        pytest.skip("no C++ toolchain")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 49157, generator=gen)  # a tail past whole vectors
    x[1, 100] = x[1, 40000] = 50.0  # a tie: the first wins
    x[2] = float("-inf")  # all -inf: index 0
    x[3, 7] = float("nan")  # NaN wins, as in torch
    x[3, 3] = float("inf")
    x[4, 49156] = float("inf")  # in the tail
    x[5] = torch.randint(0, 3, (49157,), generator=gen).float()  # many ties
    x[6, 20] = x[6, 30] = float("nan")  # the first NaN
    x[7, 0] = 1e30
    x[8, 49150:] = 60.0  # the maximum only in the tail, tied there
    assert torch.equal(cpu_elementwise.argmax(x), x.argmax(dim=-1))
    for width in (3, 8, 13, 17, 40):  # rows shorter than a vector, whole vectors, tails
        assert torch.equal(cpu_elementwise.argmax(x[:, :width].contiguous()),
                           x[:, :width].argmax(dim=-1)), width


def test_cpu_forward_padding_rows_are_zero_and_write_no_kv():
    from aserve.kernels.cpu_attention import cpu_attention_forward
    from aserve.layers.attention import AttentionMetadata

    q, kc, vc, starts, lens, table, keys, values = make_batch(DECODES, 8, 2, 64, 16,
                                                              dtype=torch.bfloat16)
    table = table.clamp(min=0)
    slots = torch.tensor([int(table[r, (n - 1) // 16]) * 16 + (n - 1) % 16
                          for r, (_, n) in enumerate(DECODES)] + [-1, -1])
    key = torch.stack([k[-1] for k in keys] + [torch.ones(2, 64)] * 2).bfloat16()
    value = torch.stack([v[-1] for v in values] + [torch.ones(2, 64)] * 2).bfloat16()
    padded = torch.cat([q, torch.full((2, 8, 64), 3.0).bfloat16()])
    before = (kc.clone(), vc.clone())
    meta = AttentionMetadata(starts, lens, table, slots, 1, max(lens.tolist()),
                             starts.tolist(), lens.tolist())
    out = cpu_attention_forward(padded, key, value, kc, vc, meta, 0.125)
    assert torch.all(out[len(DECODES):] == 0)
    want = expected(q.double(), starts, [k.bfloat16().double() for k in keys],
                    [v.bfloat16().double() for v in values], 0.125)
    torch.testing.assert_close(out[: len(DECODES)].double(), want, atol=2e-2, rtol=2e-2)
    # the decode rows rewrite the values already there; the padding rows (all ones) write nothing
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


def test_cpu_store_kv_refuses_a_slot_past_the_cache():
    from aserve.kernels.paged_attention_cpu import load_kernel as kernel

    kv = torch.randn(2, 2, 16).bfloat16()
    caches = [torch.zeros(2, 4, 1, 16, dtype=torch.bfloat16) for _ in range(2)]
    with pytest.raises(RuntimeError, match="past the cache"):
        kernel().store_kv(kv[:, :1], kv[:, 1:], *caches, torch.tensor([3, 8]))
