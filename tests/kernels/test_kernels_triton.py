"""The Triton kernels against their torch `*_ref` twins and dense attention, over a grid of shapes.

On a CUDA/ROCm machine they run on the GPU; elsewhere under the Triton interpreter
(`TRITON_INTERPRET=1`, set by conftest.py before any kernel is decorated). The interpreter is
slow, so the shapes are small, and it rounds float32 -> bfloat16 by truncation (the GPU rounds to
nearest even), so bfloat16 results are compared to one or two bfloat16 steps, not bit for bit.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from helpers.attention import MIXED, expected, make_batch  # noqa: E402

from aserve.kernels import (  # noqa: E402
    choose_num_splits,
    paged_attention_ref,
    paged_attention_triton,
    rms_norm_ref,
    rms_norm_triton,
    rotary_ref,
    rotary_triton,
    store_kv_ref,
    store_kv_triton,
)
from aserve.kernels.paged_attention_triton import _attention_kernel  # noqa: E402
from aserve.kernels.triton_utils import is_interpreted  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not is_interpreted(_attention_kernel):
    pytest.skip("no GPU, and the kernels were decorated before TRITON_INTERPRET=1 was set",
                allow_module_level=True)

# (q_len, seq_len): MIXED plus lengths at block boundaries (a whole 16-token prompt, decodes at
# 16, 32, 33, a 17-token chunk after 16 cached tokens)
BATCH = MIXED + [(16, 16), (1, 32), (1, 16), (17, 33)]
BF16_TOL = {"atol": 3e-2, "rtol": 3e-2}


def run_attention(reqs, num_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32,
                  window=None, soft_cap=None, num_splits=1, q_scale=1.0):
    """(triton output, fp64 dense expectation, batch) for one ragged batch on DEVICE."""
    q, kc, vc, starts, lens, table, keys, values = make_batch(reqs, num_heads, num_kv_heads,
                                                              head_dim, block_size, dtype=dtype)
    q = q * q_scale
    scale = head_dim**-0.5
    out = paged_attention_triton(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), starts.to(DEVICE),
                                 lens.to(DEVICE), table.to(DEVICE), scale, window, soft_cap,
                                 num_splits=num_splits)
    keys = [k.to(dtype) for k in keys]
    values = [v.to(dtype) for v in values]
    return out.cpu(), expected(q, starts, keys, values, scale, window, soft_cap)


@pytest.mark.parametrize("num_splits,block_size", [(1, 16), (2, 32)])  # (interpreter: ~1 s a case)
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (4, 1)])
def test_attention_matches_dense_on_mixed_batch(num_heads, num_kv_heads, head_dim, block_size,
                                                num_splits):
    out, want = run_attention(BATCH, num_heads, num_kv_heads, head_dim, block_size,
                              num_splits=num_splits)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size",
                         [(2, 2, 128, 16), (2, 1, 64, 8), (6, 2, 96, 32)])
def test_attention_other_head_sizes_block_sizes_and_groups(num_heads, num_kv_heads, head_dim,
                                                           block_size, num_splits):
    out, want = run_attention(MIXED[:4], num_heads, num_kv_heads, head_dim, block_size,
                              num_splits=num_splits)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("window,soft_cap", [(5, None), (1, None), (16, None), (None, 2.0),
                                             (8, 3.0)])
def test_attention_sliding_window_and_soft_cap(window, soft_cap, num_splits):
    out, want = run_attention(BATCH, 4, 2, 64, 16, window=window, soft_cap=soft_cap,
                              num_splits=num_splits, q_scale=4.0)  # large scores: the cap bites
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype,tol,block_size", [
    (torch.bfloat16, BF16_TOL, 32), (torch.float16, {"atol": 5e-3, "rtol": 5e-3}, 16)])
def test_attention_half_precision_is_close_to_float64(dtype, tol, block_size, num_splits):
    out, want = run_attention(BATCH, 4, 2, 80, block_size, dtype=dtype, num_splits=num_splits)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), want, **tol)


@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_attention_long_decodes_match_the_reference_split_or_not(num_splits):
    reqs = [(1, 300), (1, 77), (1, 513)]
    q, kc, vc, starts, lens, table, _, _ = make_batch(reqs, 4, 1, 64, 32)
    args = [x.to(DEVICE) for x in (q, kc, vc, starts, lens, table)]
    got = paged_attention_triton(*args, 0.125, num_splits=num_splits,
                                 seq_lens_cpu=lens.tolist())
    want = paged_attention_ref(q, kc, vc, starts, lens, table, 0.125)
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)


def test_choose_num_splits_splits_only_small_decode_batches_over_long_contexts():
    assert choose_num_splits(1, 3, 1, 513, num_sms=16) == 2  # by length: 513 // 256
    assert choose_num_splits(1, 2, 2, 8192, num_sms=132) == 16  # capped
    assert choose_num_splits(1, 4, 8, 4096, num_sms=132) == 9  # ~2 programs per SM
    assert choose_num_splits(5, 3, 1, 8192, num_sms=16) == 1  # a chunk in the batch
    assert choose_num_splits(1, 64, 4, 8192, num_sms=132) == 1  # fills the device already
    assert choose_num_splits(1, 3, 1, 300, num_sms=16) == 1  # too short to be worth it


@pytest.mark.parametrize("num_splits", [1, 3])
def test_attention_leaves_padding_rows_of_out_untouched(num_splits):
    q, kc, vc, starts, lens, table, keys, values = make_batch(MIXED, 4, 2, 64, 16)
    padded = torch.cat([q, torch.zeros(3, 4, 64)])  # 3 padding rows past the last request
    out = torch.full_like(padded, 7.0, device=DEVICE)
    got = paged_attention_triton(padded.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE),
                                 starts.to(DEVICE), lens.to(DEVICE), table.to(DEVICE), 0.125,
                                 out=out, query_start_loc_cpu=starts.tolist(),
                                 seq_lens_cpu=lens.tolist(), num_splits=num_splits,
                                 key=torch.zeros(1), value=torch.zeros(1))
    assert got is out
    assert torch.all(out[q.shape[0]:] == 7.0)
    want = expected(q, starts, keys, values, 0.125)
    torch.testing.assert_close(out[: q.shape[0]].cpu().double(), want, atol=2e-5, rtol=2e-5)


def test_attention_rejects_bad_shapes_and_dtypes():
    q, kc, vc, starts, lens, table, _, _ = make_batch(MIXED[:2], 4, 2, 64, 16)
    args = [x.to(DEVICE) for x in (q, kc, vc, starts, lens, table)]
    with pytest.raises(ValueError, match="do not group"):
        paged_attention_triton(args[0][:, :3], *args[1:], 0.125)
    with pytest.raises(ValueError, match="block_table"):
        paged_attention_triton(*args[:5], args[5].float(), 0.125)
    with pytest.raises(ValueError, match="share a dtype"):
        paged_attention_triton(args[0].half(), *args[1:], 0.125)


def test_launchers_say_when_triton_is_missing(monkeypatch):
    from aserve.kernels import triton_utils

    monkeypatch.setattr(triton_utils, "triton", None)
    with pytest.raises(RuntimeError, match="needs the `triton` package"):
        rms_norm_triton(torch.zeros(2, 8), torch.ones(8), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_the_asked_slots_of_strided_rows_and_skips_padding(dtype):
    heads, dim, block_size = 2, 80, 16
    qkv = torch.randn(6, (4 + 2 * heads) * dim).to(dtype)
    key = qkv[:, 4 * dim:(4 + heads) * dim].view(6, heads, dim)  # strided rows, as from a qkv
    value = qkv[:, (4 + heads) * dim:].view(6, heads, dim)
    slots = torch.tensor([17, -1, 0, 63, -1, 32])
    got = torch.zeros(2, 4, block_size, heads, dim, dtype=dtype, device=DEVICE)
    want = torch.zeros(2, 4, block_size, heads, dim, dtype=dtype)
    store_kv_triton(key.to(DEVICE), value.to(DEVICE), got[0], got[1], slots.int().to(DEVICE))
    store_kv_ref(key, value, want[0], want[1], slots)
    assert torch.equal(got.cpu(), want)


def test_store_kv_triton_rejects_mismatched_shapes():
    kv_cache = torch.zeros(2, 2, 16, 2, 8, device=DEVICE)
    key = torch.randn(3, 2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv_triton(key, key, kv_cache[0], kv_cache[1], torch.tensor([0, 1], device=DEVICE))


def assert_rounding_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to float32 sum order, or a bfloat16 step or two (interpreter truncation)."""
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(got, want, atol=1e-2, rtol=2**-6)


@pytest.mark.parametrize("shape", [(1, 96), (33, 96), (2, 3, 256)])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_reference_in_place(shape, with_residual, dtype):
    gen = torch.Generator().manual_seed(shape[0])
    x = torch.randn(*shape, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
    residual = torch.randn(*shape, generator=gen).to(dtype) if with_residual else None
    got_x = x.to(DEVICE)
    got_r = residual.to(DEVICE) if with_residual else None
    rms_norm_triton(got_x, w.to(DEVICE), 1e-5, got_r)
    rms_norm_ref(x, w, 1e-5, residual)
    assert_rounding_close(got_x.cpu(), x)
    if with_residual:
        assert_rounding_close(got_r.cpu(), residual)


def test_rms_norm_rounds_a_float32_residual_sum_to_float32():
    x = torch.randn(5, 64).bfloat16()
    residual = torch.randn(5, 64)
    w = torch.ones(64)
    got_x, got_r = x.to(DEVICE), residual.to(DEVICE)
    rms_norm_triton(got_x, w.to(DEVICE), 1e-6, got_r)
    rms_norm_ref(x, w, 1e-6, residual)
    torch.testing.assert_close(got_r.cpu(), residual, atol=1e-6, rtol=1e-6)
    assert_rounding_close(got_x.cpu(), x)


@pytest.mark.parametrize("rotary_dim", [64, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_on_strided_q_and_k_matches_the_reference(rotary_dim, dtype):
    from aserve.layers.rotary import get_rope

    rope = get_rope(64, rotary_dim, 256, 10000.0, None, dtype)
    positions = torch.randint(0, 256, (9,))
    qkv = torch.randn(9, (6 + 2 * 2) * 64).to(dtype)
    q, k = qkv[:, : 6 * 64], qkv[:, 6 * 64: 8 * 64]  # strided rows, as from a fused qkv
    got = qkv.to(DEVICE)
    rotary_triton(positions.to(DEVICE), got[:, : 6 * 64], got[:, 6 * 64: 8 * 64],
                  rope.cos_cache.to(DEVICE), rope.sin_cache.to(DEVICE), 64, rotary_dim)
    rotary_ref(positions, q, k, rope.cos_cache, rope.sin_cache, 64, rotary_dim)
    assert_rounding_close(got.cpu(), qkv)  # v (the last 128 columns) untouched on both sides


def test_rotary_on_q_only_with_float32_caches_and_head_axis():
    cos, sin = torch.randn(32, 16), torch.randn(32, 16)
    positions = torch.tensor([3, 31, 0], dtype=torch.int32)
    q = torch.randn(3, 5, 32).bfloat16()  # [T, H, D]
    got = q.to(DEVICE)
    rotary_triton(positions.to(DEVICE), got, None, cos.to(DEVICE), sin.to(DEVICE), 32, 16)
    rotary_ref(positions.long(), q, None, cos, sin, 32, 16)
    assert_rounding_close(got.cpu(), q)
